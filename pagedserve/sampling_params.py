"""What a request asks of generation, shared by the scheduler and the executor."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The widest values the executor's wire format holds (executor.proto): past them a request
# would pass here and then fail its step's encoding, which ends the engine loop.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InvalidSamplingParam(ValueError):
    """A field out of its range; ``param`` names it, as an API error reports it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParam(param, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks of generation; validated here so no caller can queue nonsense."""

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
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        n = self.n
        _require(1 <= n <= UINT32_MAX, "n", f"must be in [1, {UINT32_MAX}], got {n}")
        best_of = self.best_of
        _require(
            best_of is None or n <= best_of <= UINT32_MAX,
            "best_of",
            f"must be in [n ({n}), {UINT32_MAX}], got {best_of}",
        )
        t = self.temperature
        _require(math.isfinite(t) and t >= 0, "temperature", f"must be finite and >= 0, got {t}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        k = self.top_k
        _require(
            k == -1 or 1 <= k <= INT32_MAX,
            "top_k",
            f"must be -1 (off) or in [1, {INT32_MAX}], got {k}",
        )
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        r = self.repetition_penalty
        _require(
            math.isfinite(r) and r > 0, "repetition_penalty", f"must be finite and > 0, got {r}"
        )
        for name in ("presence_penalty", "frequency_penalty", "length_penalty"):
            value = getattr(self, name)
            _require(math.isfinite(value), name, f"must be a finite number, got {value}")
        m = self.max_tokens
        _require(1 <= m <= UINT32_MAX, "max_tokens", f"must be in [1, {UINT32_MAX}], got {m}")
        lp = self.logprobs
        _require(
            lp is None or 0 <= lp <= UINT32_MAX,
            "logprobs",
            f"must be in [0, {UINT32_MAX}], got {lp}",
        )
        ids = self.stop_token_ids
        _require(
            all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids),
            "stop_token_ids",
            f"must be token ids (integers >= 0), got {list(ids)}",
        )
        seed = self.seed
        _require(
            seed is None or INT64_MIN <= seed <= INT64_MAX,
            "seed",
            f"must be a signed 64-bit integer, got {seed}",
        )
        _require(not self.use_beam_search or t == 0, "use_beam_search", "requires temperature 0")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def width(self) -> int:
        """Sequences the group may hold at once: samples drawn, or beams kept."""
        return self.best_of if self.best_of is not None else self.n
