#!/usr/bin/env python3
"""Weight dtypes on CPU side by side: throughput of the in-process engine per ``--dtype`` (and
of vLLM's CPU build in the same dtype, with ``--vllm-python``), and how often bf16 greedy
tokens equal transformers' bf16 run.

    python bench/dtypes.py --preset alpaca --num-requests 48 --rounds 2 \\
        --json bench/results/dtypes_alpaca.json
    python bench/dtypes.py --preset sharegpt --num-requests 100 --rounds 1 \\
        --vllm-python ~/vllm-venv/bin/python

Each round runs every dtype on the same trace (greedy, exactly ``max_tokens`` each), every
other round in reverse order, and each dtype reports its mean. Agreement: ``--prompts`` English
prompts, ``--agreement-tokens`` greedy tokens each, ours with ``--dtype bfloat16`` (bf16
weights, fp32 activations) against transformers with its model in bf16 (bf16 activations too):
the share of tokens equal up to each prompt's first difference, and of prompts equal whole;
transformers' fp32 run against its bf16 one is the yardstick.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # for `bench` and `tests`

from bench import peers
from bench.common import Run, close_llm, load_trace, print_table, time_offline, write_json

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of copper.",
    "Once upon a time, in a small village by the river,",
    "The quickest way to learn a new language is",
    "def fibonacci(n):",
    "Translate to French: The weather is nice today.",
    "What is the difference between a virus and a bacterium?",
    "The three primary colours are",
    "Summarise the plot of Romeo and Juliet.",
    "In 1969, the first humans landed on",
    "A recipe for pancakes needs",
    "The main causes of the First World War were",
    "How does a refrigerator keep food cold?",
    "Give me five names for a black cat.",
    "The theory of evolution states that",
    "Photosynthesis is the process by which",
    "Write a haiku about autumn leaves.",
    "The best advice for a job interview is",
)


def throughput(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each system's and dtype's mean summary over the rounds (A B, B A, ...), keyed
    ``dtype`` for ours and ``vllm dtype`` for vLLM's."""
    trace = load_trace(args.preset, args.num_requests, args.max_model_len, args.seed)
    runs = [(system, dtype) for system in args.systems for dtype in args.dtypes]
    walls: dict[str, list[float]] = {}
    last: dict[str, Run] = {}
    for index in range(args.rounds):
        for system, dtype in runs if index % 2 == 0 else reversed(runs):
            key = dtype if system == "pagedserve" else f"{system} {dtype}"
            last[key] = run_one(system, dtype, trace, args)
            walls.setdefault(key, []).append(last[key].wall_s)
    out = {}
    for dtype, run in last.items():
        mean = Run(
            run.num_requests, statistics.fmean(walls[dtype]), run.prompt_tokens, run.output_tokens
        )
        out[dtype] = mean.summary() | {"wall_s_rounds": [round(w, 3) for w in walls[dtype]]}
    return out


def run_one(system: str, dtype: str, trace: Any, args: argparse.Namespace) -> Run:
    """One timed run of the trace: our in-process engine, or vLLM's offline LLM."""
    from pagedserve.model_files import resolve_model
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import ExecutorConfig

    if system == "vllm":
        model_dir = resolve_model(args.model)
        return peers.run_vllm(
            args.vllm_python, model_dir, trace, args.max_model_len, args.seed, dtype
        )
    config = ExecutorConfig(
        model=args.model,
        dtype=dtype,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
    )
    llm = OfflineLLM(config)
    try:
        return time_offline(llm, trace)
    finally:
        close_llm(llm)
        del llm
        gc.collect()


def agreement(args: argparse.Namespace) -> dict[str, Any]:
    """Our bf16 greedy tokens against transformers' bf16, prompt by prompt; and, as a yardstick,
    transformers' own fp32 tokens against its bf16 ones."""
    from pagedserve.offline import OfflineLLM, Request
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.settings import ExecutorConfig

    prompts = PROMPTS[: args.prompts]
    n = args.agreement_tokens
    llm = OfflineLLM(ExecutorConfig(model=args.model, dtype="bfloat16", num_gpu_blocks=512))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    requests = [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(ids)]
    ours = [r.outputs[0].token_ids for r in llm.generate(requests, progress=False)]
    close_llm(llm)
    hf_bf16 = _hf_greedy(args.model, "bfloat16", ids, n)
    return {
        "prompts": len(prompts),
        "tokens_per_prompt": n,
        "ours_bf16_vs_hf_bf16": _agree(ours, hf_bf16),
        "hf_fp32_vs_hf_bf16": _agree(_hf_greedy(args.model, "float32", ids, n), hf_bf16),
    }


def _hf_greedy(model: str, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.model_files import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=getattr(torch, dtype))
    outs = []
    for prompt in prompts:
        out = hf.eval().generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def _agree(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Prompts whose tokens are all equal, and the share of tokens before each first difference."""
    prefixes = [
        next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s))
        for s, t in zip(a, b, strict=True)
    ]
    total = sum(len(s) for s in a)
    same = sum(p == len(s) for p, s in zip(prefixes, a, strict=True))
    return {"identical_prompts": same, "token_fraction": round(sum(prefixes) / total, 4)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="alpaca")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated --dtype values")
    p.add_argument("--rounds", type=int, default=2, help="0: agreement only")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="agreement prompts; 0: none")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--vllm-python", default=None, help="also vLLM's CPU build, from this venv")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.systems = ["pagedserve"] + (["vllm"] if args.vllm_python else [])
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    runs = throughput(args) if args.rounds else {}
    print(
        f"{args.preset}: {args.num_requests} requests, {args.model}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    if runs:
        base = runs[args.dtypes[0]]["output_tokens_per_s"]
        rows = [
            [key, s["wall_s"], s["output_tokens_per_s"], s["output_tokens_per_s"] / base, ""]
            for key, s in runs.items()
        ]
        print_table(["run (vLLM's prefixed)", "wall s", "output tok/s", "ratio", "note"], rows)
    agree = agreement(args) if args.prompts else None
    if agree:
        for pair in ("ours_bf16_vs_hf_bf16", "hf_fp32_vs_hf_bf16"):
            a = agree[pair]
            print(
                f"{pair}: {a['identical_prompts']}/{agree['prompts']} prompts identical, "
                f"{a['token_fraction']:.1%} of tokens before the first difference"
            )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(
            args.json,
            config | {"threads": torch.get_num_threads()},
            {"dtypes": runs, "agreement_bf16_vs_hf_bf16": agree},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
