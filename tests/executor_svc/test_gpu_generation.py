"""The executor on a GPU against transformers on the same GPU in the same dtype: greedy
output equal token for token in fp32 and in bf16 (vLLM's rule at a near-tie: each side's
token among the other's top-5), bf16's exact agreement reported; `pagedserve serve` on
the GPU answering the official client. scripts/gpu_check.sh runs these."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.executor_svc.test_generation_vs_hf import (
    LENGTHS,
    NEW_TOKENS,
    assert_same_greedy,
    hf_greedy,
    make_prompts,
    run_ours,
    text_prompts,
)
from tests.services import serve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def agreement(ours: list, theirs: list[tuple]) -> tuple[float, float]:
    """Prompts whose tokens are all identical, and tokens identical before each prompt's
    first difference, as fractions."""
    same_prompts = same_tokens = total = 0
    for completion, (hf_tokens, _) in zip(ours, theirs, strict=True):
        tokens = completion.outputs[0].token_ids
        prefix = next(
            (i for i, (a, b) in enumerate(zip(tokens, hf_tokens, strict=True)) if a != b), None
        )
        same_prompts += prefix is None
        same_tokens += len(hf_tokens) if prefix is None else prefix
        total += len(hf_tokens)
    return same_prompts / len(theirs), same_tokens / total


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_greedy_matches_hf_on_the_gpu(tiny_model_dir: Path, dtype: str, record_property):
    prompts = make_prompts(512, LENGTHS)
    reference = hf_greedy(tiny_model_dir, prompts, NEW_TOKENS, "cuda", DTYPES[dtype])
    ours, _ = run_ours(tiny_model_dir, prompts, device="cuda", dtype=dtype)
    record_property(f"tiny_{dtype}_agreement", agreement(ours, reference))
    assert_same_greedy(ours, reference)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_greedy_matches_hf_on_the_gpu(smollm2_dir: Path, dtype: str, record_property):
    prompts = text_prompts(smollm2_dir)
    reference = hf_greedy(smollm2_dir, prompts, NEW_TOKENS, "cuda", DTYPES[dtype])
    ours, _ = run_ours(smollm2_dir, prompts, num_gpu_blocks=512, device="cuda", dtype=dtype)
    prompts_same, tokens_same = agreement(ours, reference)
    record_property(f"smollm2_{dtype}_agreement", [prompts_same, tokens_same])
    print(f"smollm2 {dtype}: {prompts_same:.0%} of prompts, {tokens_same:.1%} of tokens identical")
    assert_same_greedy(ours, reference)


@pytest.mark.slow
def test_the_server_on_the_gpu_answers_the_official_client(smollm2_dir: Path) -> None:
    from openai import OpenAI

    with serve(smollm2_dir, "--device", "cuda", "--num-gpu-blocks", "2048") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24,
            temperature=0,
        )
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0
