"""--dtype and --kv-cache-dtype on CPU: 16-bit weights under fp32 activations equal transformers
run in fp32 on the same rounded weights; a 16-bit KV pool holds twice the blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.executor import Executor
from pagedserve.settings import ExecutorConfig, PreemptionMode
from tests.executor_svc.test_generation_vs_hf import (
    LENGTHS,
    NEW_TOKENS,
    assert_same_greedy,
    hf_greedy,
    make_prompts,
    run_ours,
)


def rounded_checkpoint(model_dir: Path, dtype: torch.dtype, path: Path) -> Path:
    """The checkpoint with every weight but the norms' rounded to ``dtype``, stored in fp32:
    what ``--dtype`` computes with on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(param.to(dtype).float())
    model.save_pretrained(path)
    return path


def identical_tokens(ours: list, theirs: list) -> tuple[int, int]:
    """(tokens equal to transformers' before each prompt's first difference, all tokens)."""
    same = 0
    for completion, (hf_tokens, _) in zip(ours, theirs, strict=True):
        for a, b in zip(completion.outputs[0].token_ids, hf_tokens, strict=True):
            if a != b:
                break
            same += 1
    return same, NEW_TOKENS * len(theirs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_match_hf_on_the_rounded_weights(tiny_model_dir, tmp_path, dtype):
    prompts = make_prompts(512, LENGTHS)
    rounded = rounded_checkpoint(tiny_model_dir, getattr(torch, dtype), tmp_path / "rounded")
    reference = hf_greedy(rounded, prompts, NEW_TOKENS)
    ours, llm = run_ours(tiny_model_dir, prompts, dtype=dtype)
    executor = llm.executor
    assert executor.model.layers[0].mlp.down_proj.weight.dtype == getattr(torch, dtype)
    assert executor.model.norm.weight.dtype == torch.float32
    assert executor.cache.gpu_cache[0][0].dtype == torch.float32  # auto: the activations'
    assert_same_greedy(ours, reference)
    same, total = identical_tokens(ours, reference)
    assert same == total  # fp32 arithmetic on the same weights: no near-ties on this model


def test_16_bit_kv_cache_holds_twice_the_blocks(tiny_model_dir):
    sizes = {}
    for kv_dtype in ("auto", "bfloat16", "float16"):
        config = ExecutorConfig(
            model=str(tiny_model_dir),
            kv_cache_memory=1 << 22,
            swap_space=1 / 256,
            kv_cache_dtype=kv_dtype,
        )
        executor = Executor(config)
        info = executor.init_cache()
        sizes[kv_dtype] = (info.num_gpu_blocks, info.num_cpu_blocks)
        want = torch.float32 if kv_dtype == "auto" else getattr(torch, kv_dtype)
        assert executor.cache.gpu_cache[0][0].dtype == want
        assert executor.cache.cpu_cache[0][1].dtype == want
    blocks, swap_blocks = sizes["auto"]
    assert sizes["bfloat16"] == sizes["float16"] == (2 * blocks, 2 * swap_blocks)


@pytest.mark.parametrize("mode", [None, PreemptionMode.SWAP])
def test_bf16_kv_cache_generates_like_hf(tiny_model_dir, mode):
    """K and V rounded to bf16 in the pool (also through the swap pool) keep transformers'
    greedy tokens, up to near-ties (the module's rule)."""
    prompts = make_prompts(512, LENGTHS)
    reference = hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)
    pressure = {"num_gpu_blocks": 100, "swap_space": 0.05, "preemption_mode": mode}
    ours, llm = run_ours(
        tiny_model_dir, prompts, kv_cache_dtype="bfloat16", **(pressure if mode else {})
    )
    if mode is not None:
        assert llm.engine.stats.preemptions.get(mode.value, 0) > 0
    assert_same_greedy(ours, reference)
