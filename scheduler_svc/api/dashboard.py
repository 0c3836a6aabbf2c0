"""The live block map: snapshots of each engine's KV pools taken between its steps, served
as JSON to a self-contained page (GET /dashboard) that redraws them twice a second."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from pagedserve.step import num_freed
from scheduler_svc.core.block_allocator import BlockId
from scheduler_svc.core.sequence import SequenceStatus
from scheduler_svc.engine.engine import LLMEngine, StepOutcome

WATCH_S = 5.0  # a poll keeps snapshots coming for this long
CAPTURE_PERIOD_S = 0.1  # while watched, at most one snapshot per engine this often
FRESH_WAIT_S = 1.0  # how long a poll waits for a snapshot newer than the last step
MAX_CELLS = 16384  # a larger pool draws several blocks per cell
MAX_LISTED = 64  # request ids listed per queue
RATE_WINDOW_S = 2.0  # tokens/s is averaged over about this long

Table = tuple[int, list[BlockId]]  # (owner: index into request_ids, block ids)


@dataclass(slots=True)
class EngineView:
    """Copies of what the map shows of one engine, taken while it does not step."""

    taken: float
    block_size: int
    num_blocks: dict[str, int]  # gpu / cpu
    num_used: dict[str, int]
    request_ids: list[str]  # of the groups that hold blocks
    tables: dict[str, list[Table]]  # gpu / cpu
    cached: list[BlockId]  # gpu blocks published in the prefix cache
    queues: dict[str, tuple[int, list[str]]]  # state -> (length, first ids)


def capture_view(engine: LLMEngine, now: float) -> EngineView:
    """Copy one engine's tables and queues; O(sequences), the tables copied in C."""
    scheduler = engine.scheduler
    bm = scheduler.block_manager
    request_ids: list[str] = []
    tables: dict[str, list[Table]] = {"gpu": [], "cpu": []}
    for group in scheduler.running + scheduler.swapped:
        owner = len(request_ids)
        request_ids.append(group.request_id)
        for seq in group.seqs:
            table = bm.block_tables.get(seq.seq_id)
            if table is not None:
                device = "cpu" if seq.status == SequenceStatus.SWAPPED else "gpu"
                tables[device].append((owner, table[num_freed(table) :]))  # a copy
    queues = {
        state: (len(queue), [g.request_id for g in queue[:MAX_LISTED]])
        for state, queue in (
            ("running", scheduler.running),
            ("waiting", scheduler.waiting),
            ("swapped", scheduler.swapped),
        )
    }
    return EngineView(
        taken=now,
        block_size=bm.block_size,
        num_blocks={"gpu": bm.gpu.num_blocks, "cpu": bm.cpu.num_blocks},
        num_used={"gpu": bm.gpu.num_used_blocks, "cpu": bm.cpu.num_used_blocks},
        request_ids=request_ids,
        tables=tables,
        cached=bm.gpu.cached_block_ids(),
        queues=queues,
    )


def pool_cells(num_blocks: int, tables: list[Table], cached: list[BlockId]) -> dict[str, Any]:
    """One pool as cells: the owner (index into request_ids, -1 for none) and the number of
    table references of each cell, and the cells whose blocks are cached but held by none.
    A table's references equal the block's ref_count (the block manager's invariant)."""
    per_cell = max(1, -(-num_blocks // MAX_CELLS))
    num_cells = -(-num_blocks // per_cell)
    owner, refs = [-1] * num_cells, [0] * num_cells
    for who, table in tables:
        for block_id in table:
            cell = block_id // per_cell
            refs[cell] += 1
            if owner[cell] < 0:
                owner[cell] = who
    cached_free = sorted({b // per_cell for b in cached if refs[b // per_cell] == 0})
    return {
        "num_blocks": num_blocks,
        "blocks_per_cell": per_cell,
        "owner": owner,
        "refs": refs,
        "cached_free": cached_free,
    }


def render_view(
    name: str, view: EngineView, now: float, tokens: int, rate: float, preemptions: dict
) -> dict:
    """The JSON of one executor's map."""
    return {
        "name": name,
        "age_s": round(now - view.taken, 3),
        "block_size": view.block_size,
        "requests": view.request_ids,
        "gpu": pool_cells(view.num_blocks["gpu"], view.tables["gpu"], view.cached),
        "cpu": pool_cells(view.num_blocks["cpu"], view.tables["cpu"], []),
        "used": view.num_used,
        "queues": {s: {"count": n, "ids": ids} for s, (n, ids) in view.queues.items()},
        "preemptions": dict(preemptions),
        "generation_tokens": tokens,
        "tokens_per_s": rate,
    }


@dataclass(slots=True)
class _Engine:
    view: EngineView | None = None
    stale: bool = False  # it stepped since the view was taken
    tokens: int = 0  # sent on request streams
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)

    def tokens_per_s(self, now: float) -> float:
        """Tokens since the oldest sample of the window, over the time since then."""
        if not self.history or now <= self.history[0][0]:
            return 0.0
        since, tokens = self.history[0]
        return (self.tokens - tokens) / (now - since)


class Dashboard:
    """A StepObserver that snapshots each engine while someone watches the map (and
    whenever an engine goes idle, so an idle map is exact); costs nothing unwatched."""

    def __init__(self, capture_period_s: float = CAPTURE_PERIOD_S) -> None:
        self.capture_period_s = capture_period_s
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()
        self._polled = float("-inf")

    def after_step(self, name: str, engine: LLMEngine, outcome: StepOutcome) -> None:
        now = time.monotonic()
        tokens = sum(len(out.token_ids) for d in outcome.deltas for out in d.outputs)
        with self._lock:
            entry = self._engines.setdefault(name, _Engine())
            entry.tokens += tokens
            entry.history.append((now, entry.tokens))
            while len(entry.history) > 1 and entry.history[1][0] <= now - RATE_WINDOW_S:
                entry.history.popleft()
            for _, mode in outcome.preempted:
                entry.preemptions[mode.value] = entry.preemptions.get(mode.value, 0) + 1
            view = entry.view
            due = view is None or now - view.taken >= self.capture_period_s
            if not engine.has_unfinished() or (now - self._polled < WATCH_S and due):
                entry.view, entry.stale = capture_view(engine, now), False
            else:
                entry.stale = True

    def forget(self, name: str) -> None:
        with self._lock:
            self._engines.pop(name, None)

    async def state(self) -> dict[str, Any]:
        """Every executor's map, waiting briefly for snapshots newer than the last step."""
        self._polled = start = time.monotonic()
        while time.monotonic() - start < FRESH_WAIT_S and self._waiting_for_fresh():
            await asyncio.sleep(0.02)
        now = time.monotonic()
        with self._lock:
            entries = sorted(
                (n, e.view, e.tokens, dict(e.preemptions), e.tokens_per_s(now))
                for n, e in self._engines.items()
            )
        executors = [
            render_view(name, view, now, tokens, rate, preemptions)
            for name, view, tokens, preemptions, rate in entries
            if view is not None
        ]
        return {
            "generation_tokens": sum(e[2] for e in entries),
            "tokens_per_s": sum(e[4] for e in entries),
            "executors": executors,
        }

    def _waiting_for_fresh(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(
                e.view is None or (e.stale and now - e.view.taken > 2 * self.capture_period_s)
                for e in self._engines.values()
            )


def add_dashboard_routes(app: FastAPI, dashboard: Dashboard) -> None:
    """GET /dashboard (the page: no data, so open like /health) and GET /dashboard/state
    (the data: behind the API key, which the page takes from its URL's #key=...)."""
    page = resources.files("scheduler_svc.api").joinpath("dashboard.html").read_text()

    @app.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/state")
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(await dashboard.state(), headers={"Cache-Control": "no-store"})
