"""The second real model, Gemma 3 270M, against transformers (a file of its own, so that
the test runs beside the SmolLM2 ones, not after them)."""

from __future__ import annotations

import pytest

from tests.executor_svc.test_generation_vs_hf import (
    NEW_TOKENS,
    assert_same_greedy,
    hf_greedy,
    run_ours,
    text_prompts,
)


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_hf(gemma3_dir):
    """Local and global layers, a 262k vocabulary, on the prompts the SmolLM2 test uses
    (the first four: the vocabulary makes each step costly)."""
    prompts = text_prompts(gemma3_dir)[:4]
    reference = hf_greedy(gemma3_dir, prompts, NEW_TOKENS)
    ours, _ = run_ours(gemma3_dir, prompts, num_gpu_blocks=256)
    assert_same_greedy(ours, reference)
