"""The workload generator gives the benchmarks' traces: pinned statistics notice any change."""

from __future__ import annotations

import pytest

from bench.common import VOCAB_SIZE
from bench.workload import MIN_LEN, TOKEN_MARGIN, generate

# (preset, num_requests, seed, max_model_len, shared_prefix_len) -> prompt lengths (sum, min,
# max), output lengths (sum, min, max), sum of every prompt token id. Prompt lengths count the
# shared prefix. The last case clips prompts to max_model_len // 2 and outputs to the rest.
PINNED = {
    ("sharegpt", 200, 0, 1024, 0): ((31964, 11, 512), (61397, 27, 1011), 785668939),
    ("alpaca", 200, 0, 1024, 0): ((4112, 4, 99), (10572, 4, 328), 100395402),
    ("chat-prefix", 200, 0, 1024, 0): ((13247, 16, 209), (19800, 21, 626), 324115510),
    ("chat-prefix", 32, 0, 1024, 512): ((18696, 531, 711), (3152, 21, 290), 452483198),
    ("sharegpt", 50, 1, 128, 0): ((2542, 6, 64), (3737, 35, 115), 62374976),
}


def stats(values: list[int]) -> tuple[int, int, int]:
    return sum(values), min(values), max(values)


@pytest.mark.parametrize("case", PINNED, ids=lambda case: "-".join(map(str, case)))
def test_trace_statistics_are_pinned(case: tuple[str, int, int, int, int]) -> None:
    preset, num_requests, seed, max_model_len, prefix_len = case
    requests = generate(preset, num_requests, VOCAB_SIZE, seed, max_model_len, prefix_len)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    output_lens = [r.max_tokens for r in requests]
    token_sum = sum(sum(r.prompt_token_ids) for r in requests)
    assert len(requests) == num_requests
    assert (stats(prompt_lens), stats(output_lens), token_sum) == PINNED[case]


@pytest.mark.parametrize("case", PINNED, ids=lambda case: "-".join(map(str, case)))
def test_requests_fit_the_model(case: tuple[str, int, int, int, int]) -> None:
    preset, num_requests, seed, max_model_len, prefix_len = case
    requests = generate(preset, num_requests, VOCAB_SIZE, seed, max_model_len, prefix_len)
    prefix = requests[0].prompt_token_ids[:prefix_len]
    for r in requests:
        own_len = len(r.prompt_token_ids) - prefix_len
        assert r.prompt_token_ids[:prefix_len] == prefix
        assert MIN_LEN <= own_len <= max_model_len // 2
        assert 1 <= r.max_tokens <= max_model_len - len(r.prompt_token_ids)
        ids = r.prompt_token_ids
        assert TOKEN_MARGIN <= min(ids) <= max(ids) < VOCAB_SIZE - TOKEN_MARGIN


def test_a_longer_trace_starts_with_the_shorter_one() -> None:
    short = generate("alpaca", 5, VOCAB_SIZE, 3, 1024)
    assert generate("alpaca", 20, VOCAB_SIZE, 3, 1024)[:5] == short
    assert generate("alpaca", 5, VOCAB_SIZE, 4, 1024) != short


def test_caller_mistakes_raise() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        generate("lmsys", 1, VOCAB_SIZE, 0, 1024)
    with pytest.raises(ValueError, match="no output"):
        generate("sharegpt", 1, VOCAB_SIZE, 0, 64, shared_prefix_len=64)
    assert generate("sharegpt", 0, VOCAB_SIZE, 0, 1024) == []
