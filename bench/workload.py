"""The benchmarks' workload generator: synthetic requests shaped like the paper's traces.

A request is a prompt of random token ids and the exact number of tokens to generate (EOS
ignored), so every engine does the same work. Prompt and output lengths are log-normal with
the means the PagedAttention paper gives for its traces (ShareGPT 161 in / 338 out, Alpaca
19 in / 58 out), then clipped to the model:

    |<- shared prefix ->|<- prompt: <= max_model_len // 2 ->|<- output ->|
    |<------------------------- <= max_model_len ----------------------->|

One ``random.Random(seed)`` draws everything in a fixed order (the prefix, then per request
its prompt length, output length and prompt tokens), so a preset, seed and count always give
the same trace, and a longer trace starts with a shorter one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MIN_LEN = 4  # shortest prompt and output drawn
TOKEN_MARGIN = 100  # ids this close to either end of the vocabulary (special tokens) unused


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal length with mean ``mean``; ``sigma`` is the spread of its logarithm."""

    mean: float
    sigma: float

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2  # E[X] = exp(mu + sigma^2 / 2)
        return max(MIN_LEN, int(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True, slots=True)
class Preset:
    prompt: LogNormal
    output: LogNormal


PRESETS: dict[str, Preset] = {
    "sharegpt": Preset(LogNormal(161.0, 1.0), LogNormal(338.0, 0.9)),
    "alpaca": Preset(LogNormal(19.0, 0.6), LogNormal(58.0, 0.8)),
    # Short chat turns behind a long common system prompt (--shared-prefix-len): prefix sharing.
    "chat-prefix": Preset(LogNormal(64.0, 0.5), LogNormal(96.0, 0.6)),
}


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def generate(
    preset: str,
    num_requests: int,
    vocab_size: int,
    seed: int,
    max_model_len: int,
    shared_prefix_len: int = 0,
) -> list[Request]:
    """``num_requests`` requests of ``preset``; every prompt starts with the same
    ``shared_prefix_len`` tokens.

    Raises:
        ValueError: an unknown preset, or a request left with no room for output.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    dist, rng = PRESETS[preset], random.Random(seed)
    lo, hi = TOKEN_MARGIN, vocab_size - TOKEN_MARGIN
    prefix = [rng.randrange(lo, hi) for _ in range(shared_prefix_len)]
    requests = []
    for _ in range(num_requests):
        prompt_len = min(dist.prompt.sample(rng), max_model_len // 2)
        output_len = min(dist.output.sample(rng), max_model_len - shared_prefix_len - prompt_len)
        if output_len < 1:
            raise ValueError(
                f"max_model_len {max_model_len} leaves no output for a prompt of "
                f"{shared_prefix_len} + {prompt_len} tokens"
            )
        prompt = prefix + [rng.randrange(lo, hi) for _ in range(prompt_len)]
        requests.append(Request(prompt, output_len))
    return requests
