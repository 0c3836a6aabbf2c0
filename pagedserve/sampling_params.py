"""What a request asks of generation, shared by the scheduler and the executor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.grammar import Grammar

# The widest values the executor's wire format holds (executor.proto): past them a request
# would pass here and then fail its step's encoding, which ends the engine loop.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Bounds that keep any value from overflowing the logits or a beam's score, set at OpenAI's
# documented ranges where it documents them.
GREEDY_BELOW = 1e-5  # dividing logits by less overflows them; vLLM draws greedily there too
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0  # divides positive logits
MAX_LENGTH_PENALTY = 10.0  # an output length to this power stays far inside a float


class InvalidSamplingParam(ValueError):
    """A field out of its range; ``param`` names it, as an API error reports it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


_SYMMETRIC_RANGES = (
    ("presence_penalty", MAX_PENALTY),
    ("frequency_penalty", MAX_PENALTY),
    ("length_penalty", MAX_LENGTH_PENALTY),
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks of generation; validated here so no caller can queue nonsense.

    A temperature below GREEDY_BELOW becomes 0 (greedy): a sampled draw at such a
    temperature is the greedy token anyway, and dividing logits by it overflows them.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, cut from the returned text
    seed: int | None = None
    logprobs: int | None = None
    # Alternatives reported per prompt token; None: the prompt is not scored. A prompt
    # scored is computed whole: prefix-cached blocks hold no logits to score it with.
    prompt_logprobs: int | None = None
    length_penalty: float = 1.0
    grammar: Grammar | None = None  # constrains every token drawn (structured outputs)
    # Scheduling, not sampling: never sent to the executor.
    priority: int = 0  # lower runs first (FCFS within a priority), preempted last
    timeout: float | None = None  # seconds from arrival after which the request is ended

    def __post_init__(self) -> None:
        # Each message is formatted only on failure: this runs for every request.
        bad = InvalidSamplingParam
        n, best_of, t, k = self.n, self.best_of, self.temperature, self.top_k
        if not 1 <= n <= UINT32_MAX:
            raise bad("n", f"must be in [1, {UINT32_MAX}], got {n}")
        if best_of is not None and not n <= best_of <= UINT32_MAX:
            raise bad("best_of", f"must be in [n ({n}), {UINT32_MAX}], got {best_of}")
        if not (math.isfinite(t) and t >= 0):
            raise bad("temperature", f"must be finite and >= 0, got {t}")
        if 0 < t < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (k == -1 or 1 <= k <= INT32_MAX):
            raise bad("top_k", f"must be -1 (off) or in [1, {INT32_MAX}], got {k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        r = self.repetition_penalty
        if not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            bounds = f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"
            raise bad("repetition_penalty", f"must be in {bounds}, got {r}")
        for name, bound in _SYMMETRIC_RANGES:
            if not -bound <= getattr(self, name) <= bound:
                raise bad(name, f"must be in [-{bound}, {bound}], got {getattr(self, name)}")
        # 0 scores the prompt and draws nothing: without prompt_logprobs it would do nothing.
        lowest = 0 if self.prompt_logprobs is not None else 1
        if not lowest <= self.max_tokens <= UINT32_MAX:
            raise bad("max_tokens", f"must be in [{lowest}, {UINT32_MAX}], got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= UINT32_MAX:
                raise bad(name, f"must be in [0, {UINT32_MAX}], got {value}")
        if not all(_is_int(i) and 0 <= i <= INT32_MAX for i in self.stop_token_ids):
            ids = list(self.stop_token_ids)
            raise bad("stop_token_ids", f"must be token ids (integers >= 0), got {ids}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad("seed", f"must be a signed 64-bit integer, got {self.seed}")
        if not (_is_int(self.priority) and INT32_MIN <= self.priority <= INT32_MAX):
            raise bad("priority", f"must be a 32-bit integer, got {self.priority}")
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout > 0):
            raise bad("timeout", f"must be a finite number of seconds > 0, got {self.timeout}")
        if self.use_beam_search and self.temperature != 0:
            raise bad("use_beam_search", "requires temperature 0")
        if self.use_beam_search and self.grammar is not None:
            raise bad("use_beam_search", "cannot be combined with structured outputs")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_output_tokens(self) -> bool:
        """Whether the executor needs the output so far: for penalties, or to rebuild a
        grammar's state when it has none for the sequence."""
        return self.has_penalties or self.grammar is not None

    @property
    def width(self) -> int:
        """Sequences the group may hold at once: samples drawn, or beams kept."""
        return self.best_of if self.best_of is not None else self.n
