"""The pace of the running streams, which admission must not spoil.

Each sequence a step admits makes every later step longer for all running streams: on a
loaded executor a token's time grows with the batch, and each admitted prompt adds its
prefill to a step. A bounded queue bounds memory, not that: under ten times the
sustainable rate the batch fills to ``max_num_seqs``, every stream slows several times
over, and a step that admits a token budget's worth of prompts stalls them all for
seconds. So once requests queue up (PACING_BACKLOG of them wait: arrivals outpace the executor
by far) the scheduler paces admission by the time a token has been taking lately against
the fastest it has seen (an idle executor's): none while past the limit, one newcomer a
step while past half of it; the others wait, or the front door refuses them once the
queue is full. Short of that backlog every newcomer goes in as soon as it fits, as
without a limit: near the sustainable rate, or a little past it, holding requests back
would trade their first token's wait for the others' pace, and a backlog that builds
slowly reaches PACING_BACKLOG late, while ten times the sustainable rate does in a second.
"""

from __future__ import annotations

import math

from pagedserve.settings import PACING_BACKLOG

WEIGHT = 0.25  # of the newest step in the running mean (about the last seven steps)


class TokenPace:
    """Seconds per token of recent steps (a running mean) against the fastest seen."""

    def __init__(self, max_slowdown: float) -> None:
        """Args:
        max_slowdown: how many times the fastest seen a token may have been taking
            lately for waiting requests to be let in (0: no limit).
        """
        self.max_slowdown = max_slowdown
        self.fastest = math.inf
        self.recent = 0.0

    def observe(self, seconds_per_token: float) -> None:
        """A step applied right after another: ``seconds_per_token`` between them."""
        if self.fastest == math.inf:
            self.recent = seconds_per_token
        self.recent += WEIGHT * (seconds_per_token - self.recent)
        self.fastest = min(self.fastest, seconds_per_token)

    def admits(self, num_waiting: int) -> int | None:
        """How many of the ``num_waiting`` waiting groups the next step may admit: None
        (as many as fit), 1, or 0 past the limit."""
        limit = self.max_slowdown * self.fastest
        if num_waiting < PACING_BACKLOG or not 0 < limit < math.inf or self.recent <= limit / 2:
            return None
        return 1 if self.recent <= limit else 0
