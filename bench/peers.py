"""The peers of the throughput benchmark: transformers' static and continuous batching, vLLM.

Each loads the same checkpoint in fp32, runs greedy, and counts only the tokens each
request asked for (``max_tokens``, EOS ignored); load and warm-up are not timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import Run, Trace, progress
from bench.launch import vllm_env

WARMUP_TOKENS = 4
CB_PAGE_SIZE = 256  # transformers' default page, in tokens


def load_hf(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def run_hf_static(model: Any, trace: Trace, batch_size: int) -> Run:
    """Static batches in arrival order, left-padded; each batch runs to its longest request,
    and only the requested tokens count as output (the peers' measure in PEERS.md)."""
    _hf_generate(model, [trace.prompts[0][:8]], WARMUP_TOKENS)
    n = trace.num_requests
    with progress(n, f"hf batch {batch_size}") as bar:
        start = time.perf_counter()
        for i in range(0, n, batch_size):
            end = min(i + batch_size, n)
            _hf_generate(model, trace.prompts[i:end], max(trace.output_lens[i:end]))
            bar.update(end - i)
        wall = time.perf_counter() - start
    note = f"static batches of {batch_size}"
    return Run(n, wall, sum(trace.prompt_lens), sum(trace.output_lens), note)


def _hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> None:
    import torch

    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )


def run_hf_continuous(model: Any, trace: Trace, kv_tokens: int, max_batch_tokens: int) -> Run:
    """transformers' continuous batching (``init_continuous_batching``): every request
    queued at once with its own ``max_new_tokens``; EOS disabled with id -1.

    Its paged cache gets the same ``kv_tokens`` as pagedserve's pool: left to size itself,
    it takes 90% of the host's memory and gets killed on a shared machine.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(trace.output_lens), eos_token_id=-1, pad_token_id=0
    )
    cb_config = ContinuousBatchingConfig(
        num_blocks=-(-kv_tokens // CB_PAGE_SIZE),
        page_size=CB_PAGE_SIZE,
        max_batch_tokens=max_batch_tokens,
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb_config
    )
    manager.start()
    try:
        _cb_wait(manager, {"warmup": (trace.prompts[0][:8], WARMUP_TOKENS)}, None)
        pairs = zip(trace.prompts, trace.output_lens, strict=True)
        jobs = {f"r{i}": job for i, job in enumerate(pairs)}
        with progress(len(jobs), "hf-cb") as bar:
            start = time.perf_counter()
            output_tokens = _cb_wait(manager, jobs, bar)
            wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    note = f"KV cache of {kv_tokens} tokens in pages of {CB_PAGE_SIZE}, as pagedserve's pool"
    return Run(trace.num_requests, wall, sum(trace.prompt_lens), output_tokens, note)


def _cb_wait(manager: Any, jobs: dict[str, tuple[list[int], int]], bar: Any) -> int:
    """Queue ``jobs`` (id -> (prompt, max_new_tokens)); return the tokens generated."""
    for request_id, (prompt, max_new_tokens) in jobs.items():
        manager.add_request(
            prompt, request_id=request_id, max_new_tokens=max_new_tokens, eos_token_id=-1
        )
    pending, output_tokens = set(jobs), 0
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.request_id not in pending or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"hf-cb request {result.request_id}: {result.error}")
        pending.discard(result.request_id)
        output_tokens += len(result.generated_tokens)
        if bar is not None:
            bar.update(1)
    return output_tokens


VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
RESULT, model, dtype, max_model_len, seed, prompts, outs = json.load(sys.stdin)
llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed)
prompts = [{"prompt_token_ids": p} for p in prompts]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
done = llm.generate(prompts, params)
wall = time.perf_counter() - start
print(RESULT, json.dumps([wall, sum(len(o.outputs[0].token_ids) for o in done)]), flush=True)
"""
VLLM_RESULT = "PAGEDSERVE_BENCH_RESULT"  # vLLM logs to stdout too, even after the result


def run_vllm(
    python: str,
    model_dir: Path,
    trace: Trace,
    max_model_len: int,
    seed: int,
    dtype: str = "float32",
) -> Run:
    """vLLM's offline LLM in its own venv, every core bound (PEERS.md)."""
    job = [VLLM_RESULT, str(model_dir), dtype, max_model_len, seed]
    job += [trace.prompts, trace.output_lens]
    done = subprocess.run(
        [python, "-c", VLLM_SCRIPT],
        input=json.dumps(job),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        env=vllm_env() | dict(os.environ),  # the caller's settings win
    )
    results = [line for line in done.stdout.splitlines() if line.startswith(VLLM_RESULT)]
    if not results:
        raise RuntimeError(f"vLLM printed no result; its output ended with: {done.stdout[-500:]}")
    wall, output_tokens = json.loads(results[-1].removeprefix(VLLM_RESULT))
    return Run(trace.num_requests, wall, sum(trace.prompt_lens), output_tokens)
