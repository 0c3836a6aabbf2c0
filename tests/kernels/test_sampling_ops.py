"""pagedserve_kernels.sampling_ops.greedy (C++ on CPU in fp32) against argmax and log_softmax
in float64."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import sampling_ops


def _expected(logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    token_ids = logits.double().argmax(dim=-1)
    logprobs = torch.log_softmax(logits.double(), dim=-1).gather(1, token_ids.unsqueeze(1))
    return token_ids.tolist(), logprobs.squeeze(1)


@pytest.mark.parametrize("rows", [1, 3, 100])
@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 49157])
def test_greedy_matches_argmax_and_log_softmax(rows: int, vocab: int) -> None:
    # vocab 7 and 49157 leave a tail past the last full vector; 49152 is SmolLM2's.
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 8
    token_ids, logprobs = sampling_ops.greedy(logits)
    expected_ids, expected_logprobs = _expected(logits)
    assert token_ids.dtype == torch.long and token_ids.tolist() == expected_ids
    torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=1e-5)


def test_equal_maxima_give_the_first_index() -> None:
    logits = torch.zeros(4, 43)  # five vectors of 8, then a tail of 3
    logits[0, [21, 13, 5]] = 2.0  # one lane, three vectors
    logits[1, [30, 3]] = 1.0  # two lanes
    logits[2, [41, 37]] = 1.0  # the tail and a vector
    logits[3, [42, 41]] = 1.0  # the tail alone
    token_ids, logprobs = sampling_ops.greedy(logits)
    assert token_ids.tolist() == [5, 3, 37, 41]
    torch.testing.assert_close(logprobs.double(), _expected(logits)[1], atol=1e-6, rtol=1e-6)


def test_strided_rows_and_other_dtypes_take_their_paths() -> None:
    wide = torch.randn(4, 2 * 1000, generator=torch.Generator().manual_seed(1)) * 4
    strided = wide[:, 1000:]  # rows strided, elements contiguous: the kernel
    # Elements strided, float64 and bfloat16: the torch fallback.
    for logits in (strided, wide[:, ::2], strided.double(), strided.bfloat16()):
        token_ids, logprobs = sampling_ops.greedy(logits)
        expected_ids, expected_logprobs = _expected(logits)
        assert token_ids.tolist() == expected_ids
        torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=1e-5)
