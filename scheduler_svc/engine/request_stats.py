"""Per-request timings and token counts, fed by step outcomes: the source of the request
metrics and of the one log line per finished request (and per preemption)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.core.sequence import SequenceGroup

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import StepOutcome
    from scheduler_svc.state.streams import RequestDelta

log = structlog.get_logger(__name__)

# A request with several outputs ends for the most telling of their reasons.
_REASON_ORDER = ("abort", "length", "stop")
# Finished requests remembered so that a new term finishing one again is not counted twice.
REMEMBERED_FINISHED = 4096


@dataclass(slots=True)
class FinishedRequest:
    """One request's account, as logged and observed in the histograms (seconds)."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int  # tokens sent on the request's stream, all outputs together
    num_preemptions: int
    ttft: float | None  # arrival -> first token; None when no token was produced
    tpot: float | None  # mean time between decode steps; None with fewer than 2
    e2e: float | None  # arrival -> finish; None when the arrival is unknown


@dataclass(slots=True)
class StepSummary:
    """What one step added to the request counters."""

    generation_tokens: int = 0
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass(slots=True)
class _Live:
    group: SequenceGroup | None
    arrival: float | None
    first_token: float | None = None
    generation_tokens: int = 0


class RequestTracker:
    """Follows each request from the first step that sees it to its final stream event.

    Token counts come from the stream deltas (``outcome.deltas``), so they equal what the
    clients received. Times are wall-clock seconds, the clock of ``arrival_time`` (stamped
    by whichever replica took the request); an arrival in the future counts as now.
    Safe to feed from the threads of several engines.

    A step whose commit never landed (the store went away, the leader stepped down) was
    observed all the same, and the next term recomputes it from the journal: a request it
    finished finishes again. The last REMEMBERED_FINISHED finished ids are kept, and what
    comes for one of them is not counted again.
    """

    def __init__(self) -> None:
        self._live: dict[str, _Live] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_live(self) -> int:
        return len(self._live)

    def observe(self, outcome: StepOutcome, now: float) -> StepSummary:
        """Account one step; logs each preemption and each finished request."""
        summary = StepSummary()
        with self._lock:
            done = self._finished
            for group in outcome.groups:
                live = self._live.get(group.request_id)
                if live is not None and live.group is group and live.first_token is not None:
                    continue  # the common case, every step of a running request
                if group.request_id in done:
                    continue
                if live is None or live.group is not group:
                    live = self._get(group.request_id, group, now)
                if live.first_token is None and any(s.output_token_ids for s in group.seqs):
                    live.first_token = now
            ended = {g.request_id: g for g in outcome.finished}
            for delta in outcome.deltas:
                if delta.request_id in done:
                    continue
                num_tokens = sum(len(out.token_ids) for out in delta.outputs)
                summary.generation_tokens += num_tokens
                live = self._get(delta.request_id, ended.get(delta.request_id), now)
                live.generation_tokens += num_tokens
                if delta.finished:
                    del self._live[delta.request_id]
                    summary.finished.append(_finish(delta, live, now))
                    done[delta.request_id] = None
                    if len(done) > REMEMBERED_FINISHED:
                        done.popitem(last=False)
        for group, mode in outcome.preempted:
            log.info(
                "request preempted",
                request_id=group.request_id,
                mode=mode.value,
                num_preemptions=group.num_preemptions,
            )
        for done in summary.finished:
            log.info(
                "request finished",
                request_id=done.request_id,
                finish_reason=done.finish_reason,
                prompt_tokens=done.prompt_tokens,
                generation_tokens=done.generation_tokens,
                num_preemptions=done.num_preemptions,
                ttft_s=_round(done.ttft),
                tpot_s=_round(done.tpot),
                e2e_s=_round(done.e2e),
            )
        return summary

    def _get(self, request_id: str, group: SequenceGroup | None, now: float) -> _Live:
        live = self._live.get(request_id)
        if live is None:
            arrival = min(group.arrival_time, now) if group is not None else None
            live = self._live[request_id] = _Live(group, arrival)
        elif live.group is None and group is not None:
            live.group, live.arrival = group, min(group.arrival_time, now)
        elif group is not None:  # restored by a new term: the old object is stale
            live.group = group
        return live


def _finish(delta: RequestDelta, live: _Live, now: float) -> FinishedRequest:
    group = live.group
    if group is not None:
        reasons = {seq.status.finish_reason for seq in group.outputs()}
        num_steps = max((len(s.output_token_ids) for s in group.seqs), default=0)
    else:
        reasons = {out.finish_reason for out in delta.outputs}
        num_steps = live.generation_tokens
    reason = next((r for r in _REASON_ORDER if r in reasons), "abort")
    first = live.first_token
    if first is None and live.generation_tokens:  # a stream that started on its last step
        first = now
    arrival = live.arrival
    return FinishedRequest(
        request_id=delta.request_id,
        finish_reason=reason,
        prompt_tokens=delta.prompt_len,
        generation_tokens=live.generation_tokens,
        num_preemptions=group.num_preemptions if group is not None else 0,
        ttft=first - arrival if first is not None and arrival is not None else None,
        tpot=(now - first) / (num_steps - 1) if first is not None and num_steps > 1 else None,
        e2e=now - arrival if arrival is not None else None,
    )


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
