"""Admission at the leader's front door: a request is refused (429, retry later) rather
than queued when the queue already holds too many requests or prompt tokens, or when at
the rate the queue has been draining it would wait longer than a client can be expected
to. A count alone bounds memory, not latency: under ten times the sustainable rate a
queue of a hundred requests means minutes of waiting, and clients give up on requests
the server goes on to run.

The queue drains as requests get their first event, so that is the rate measured, not
the rate requests finish: finishes lag a rise in load by a whole answer's time (a minute
of decoding), and a server that had just taken on a burst judged it by the few finishes
of the quiet spell before it and refused requests it was about to admit. The rate is that
of the last few first events, not of all in a long window: under ten times the
sustainable rate the first seconds admit dozens at once, then pacing lets in one a step,
and a window's mean kept promising the first seconds' pace for half a minute."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.state.streams import QueueFullError

RATE_STARTS = 8  # the last first events the drain rate is measured over
RATE_WINDOW_S = 30.0  # older than this, they say nothing about the rate now


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What the waiting queue may hold: requests, prompt tokens, and the seconds a new
    request may expect to wait for its first step (0: no bound on the wait)."""

    requests: int = 1024
    tokens: int = 1 << 20
    wait_s: float = 60.0


DEFAULT_LIMITS = AdmissionLimits()


class Admission:
    """Judges each new request against the limits and the queue as it stands; told of
    every request's first event, it knows how fast the queue drains."""

    def __init__(
        self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.clock = clock
        self._started: deque[float] = deque(maxlen=RATE_STARTS)
        self._queued_since: float | None = None  # an arrival last found the queue empty

    def started(self) -> None:
        """A request had its first event: it left the queue."""
        self._started.append(self.clock())

    def drain_rate(self) -> float | None:
        """Requests that left the queue per second, over the last RATE_STARTS first events
        and the time since (None: fewer, or older than RATE_WINDOW_S). Time the queue
        stood empty after the last of them does not count: nothing started then because
        nothing waited, and a burst after a steady spell would be judged by it."""
        now = self.clock()
        started = self._started
        if len(started) < RATE_STARTS or started[0] < now - RATE_WINDOW_S:
            return None
        queued = self._queued_since
        idle = 0.0 if queued is None else max(0.0, queued - started[-1])
        return (len(started) - 1) / max(now - started[0] - idle, 1e-9)

    def check(self, waiting_requests: int, waiting_tokens: int, prompt_len: int) -> None:
        """Raise QueueFullError when a request of ``prompt_len`` tokens joining this queue
        would exceed a limit."""
        limits = self.limits
        if not waiting_requests:
            self._queued_since = self.clock()
        if waiting_requests + 1 > limits.requests or waiting_tokens + prompt_len > limits.tokens:
            raise QueueFullError(
                f"{waiting_requests} requests ({waiting_tokens} prompt tokens) already wait "
                f"for a first step, at most {limits.requests} ({limits.tokens} tokens); "
                "retry later",
                "queue_full",
            )
        rate = self.drain_rate() if limits.wait_s > 0 and waiting_requests else None
        if rate is not None and (expected := (waiting_requests + 1) / rate) > limits.wait_s:
            raise QueueFullError(
                f"{waiting_requests} requests wait for a first step; at the {rate:.1f} per "
                f"second leaving the queue now this one would wait about {expected:.0f} s, more "
                f"than the {limits.wait_s:g} s allowed; retry later",
                "queue_wait",
            )
