"""One lane per executor: the engine that drives it and what waits to enter it.

A lane's engine (its scheduler, block manager and journal) is only ever touched by the
thread that steps it; other coroutines hand it work through the lane's lists under its
lock, and wake it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.core.scheduler import RequestRejectedError
from scheduler_svc.core.sequence import SequenceGroup
from scheduler_svc.engine.engine import LLMEngine, StepOutcome
from scheduler_svc.engine.reconnect import ExecutorGone
from scheduler_svc.state.streams import RequestDelta

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float


@dataclass(slots=True)
class Move:
    """A group leaving one store lane to be recomputed on another executor's lane."""

    group: SequenceGroup
    num_events: int  # stream events it has emitted so far
    source: str  # the store lane it leaves (its lane_name): its copy there goes at commit


@dataclass(eq=False)
class Lane:
    """An executor, its engine, and the adds, moves and aborts queued for its next step."""

    name: str  # the executor's address
    engine: LLMEngine
    draining: bool = False  # receives no new groups
    retiring: bool = False  # evacuate everything at the next chance, then stop
    incoming: list[NewRequest] = field(default_factory=list)
    arriving: list[Move] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    landing: list[Move] = field(default_factory=list)  # taken from arriving, not committed
    lock: threading.Lock = field(default_factory=threading.Lock)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def in_flight(self) -> list[Move]:
        """Groups on their way here: queued, or taken into the engine and not committed."""
        with self.lock:
            return [*self.arriving, *self.landing]

    def has_work(self) -> bool:
        with self.lock:
            queued = bool(self.incoming or self.arriving or self.aborts)
        return queued or self.retiring or self.engine.has_unfinished()

    def free_room(self) -> int:
        """Free KV blocks net of the prompts queued here: the router's measure of room."""
        bm = self.engine.scheduler.block_manager
        with self.lock:
            queued = [r.prompt for r in self.incoming]
        queued += [g.seqs[0].prompt_token_ids for g in list(self.engine.scheduler.waiting)]
        return bm.gpu.num_free_blocks - sum(bm.blocks_for(len(p)) for p in queued)

    def fits(self, prompt_len: int, params: SamplingParams) -> bool:
        try:
            self.engine.scheduler.check_fits(prompt_len, params)
        except RequestRejectedError:
            return False
        return True

    def step(self) -> tuple[StepOutcome, list[Move]]:
        """Lane thread: take queued work, then one step. Returns the outcome and, when the
        lane retires, the groups to move to other executors."""
        engine = self.engine
        with self.lock:
            incoming, self.incoming = self.incoming, []
            arriving, self.arriving = self.arriving, []
            self.landing = arriving
            aborts, self.aborts = self.aborts, []
        ended: list[RequestDelta | None] = []
        for r in incoming:
            try:
                engine.add_request(r.request_id, r.prompt, r.params, r.arrival)
            except Exception as e:  # this request's alone: the others go on
                ended.append(self._drop(r.request_id, len(r.prompt), e))
        for move in arriving:
            try:
                engine.attach(move.group, move.num_events, move.source)
            except Exception as e:
                ended.append(self._drop(move.group.request_id, move.group.prompt_len, e, move))
        flushed: list[RequestDelta] = []  # events the flush made, committed with it
        if arriving:
            flushed = engine.flush()  # the move is durable here before the old lane lets go
            with self.lock:
                self.landing = []
        aborted: list[SequenceGroup] = []
        for request_id in aborts:
            group = engine.abort(request_id)
            if group is not None:
                aborted.append(group)
                ended.append(engine.streams.delta(group, finished=True))
        if engine.journal is not None:
            engine.journal.defer([d for d in ended if d is not None and d.error is None])
        expired, deadline_deltas = engine.expire(time.time())
        aborted += expired
        ended += deadline_deltas
        outcome, moved = StepOutcome(), []
        if not self.retiring and engine.has_unfinished():
            try:
                outcome = engine.step()
            except ExecutorGone:  # abandoned while it was away: the step in flight is void
                self.retiring = True
        if self.retiring:
            source = engine.journal.store.lane_name if engine.journal is not None else self.name
            told, groups = engine.evacuate()
            outcome.deltas += told
            moved = [Move(group, events, source) for group, events in groups]
        outcome.deltas[:0] = flushed + [d for d in ended if d is not None]
        outcome.finished[:0] = aborted
        return outcome, moved

    def _drop(
        self, request_id: str, prompt_len: int, error: Exception, move: Move | None = None
    ) -> RequestDelta:
        log.warning("request dropped", request_id=request_id, executor=self.name, error=str(error))
        if move is None:
            return self.engine.drop(request_id, prompt_len, str(error))
        return self.engine.drop(request_id, prompt_len, str(error), move.num_events, move.source)
