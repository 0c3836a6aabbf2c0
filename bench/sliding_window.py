#!/usr/bin/env python3
"""What returning blocks outside a sliding window saves: a long trace on a fixed KV pool.

A Mistral-style model whose every layer attends to its last ``--window`` positions (a tiny
random one unless ``--model`` names a checkpoint) serves prompts and outputs of thousands of
tokens, all submitted at once, in process, twice on the same pool: with the blocks that fall
wholly before the window returned to the pool as the sequences grow, and with every block
held until its sequence ends. Reported per setting: the KV blocks in use (peak, and the mean
over engine steps), the most sequences running at once, preemptions, and throughput.

    python bench/sliding_window.py --num-requests 12 --window 512 --num-gpu-blocks 1024 \\
        --json bench/results/sliding_window.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.common import close_llm, print_table, progress, pyplot, write_json

SETTINGS = {"freed": True, "kept": False}  # name -> EngineOptions.free_outside_window
VOCAB = 512  # the tiny model's


def save_tiny_mistral(path: Path, window: int, max_model_len: int) -> Path:
    """A seeded random Mistral small enough that attention and block handling dominate."""
    import torch
    import transformers

    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def make_trace(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request, lengths uniform in the given ranges."""
    rng = random.Random(args.seed)
    trace = []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(*args.prompt_lens)
        output_len = min(rng.randint(*args.output_lens), args.max_model_len - prompt_len)
        trace.append(([rng.randrange(3, VOCAB) for _ in range(prompt_len)], output_len))
    return trace


def run_setting(model: str, args: argparse.Namespace, free: bool, name: str) -> dict[str, Any]:
    """The whole trace on one engine, sampling the pool after every step."""
    from pagedserve.offline import OfflineLLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.settings import EngineOptions, ExecutorConfig

    executor = ExecutorConfig(
        model=model,
        dtype="float32",
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        swap_space=args.swap_space,
        max_model_len=args.max_model_len,
    )
    options = EngineOptions(
        max_num_batched_tokens=args.max_num_batched_tokens,
        free_outside_window=free,
        decode_steps_quiet_s=0.0,
    )
    llm = OfflineLLM(executor, options)
    engine, trace = llm.engine, make_trace(args)
    seqs = []
    for i, (prompt, output_len) in enumerate(trace):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        seqs += engine.add_request(str(i), prompt, params, arrival_time=i).seqs
    bm = engine.scheduler.block_manager
    used, running = [], []
    start = time.perf_counter()
    with progress(sum(n for _, n in trace), f"{name}: output tokens", unit="tok") as bar:
        while engine.has_unfinished():
            engine.step()
            used.append(bm.gpu.num_used_blocks)
            running.append(sum(len(g.seqs) for g in engine.scheduler.running))
            bar.update(sum(len(s.output_token_ids) for s in seqs) - bar.n)
    wall = time.perf_counter() - start
    output_tokens = sum(len(s.output_token_ids) for s in seqs)
    result = {
        "sliding_window": bm.sliding_window,  # 0: every block kept
        "pool_blocks": bm.gpu.num_blocks,
        "peak_blocks_used": max(used),
        "mean_blocks_used": round(statistics.fmean(used), 1),
        "max_running_seqs": max(running),
        "mean_running_seqs": round(statistics.fmean(running), 2),
        "blocks_freed_outside_window": bm.counters.window_freed_blocks,
        "preemptions": sum(engine.stats.preemptions.values()),
        "steps": engine.stats.num_steps,
        "wall_s": round(wall, 2),
        "output_tokens": output_tokens,
        "output_tok_per_s": round(output_tokens / wall, 1),
        "used_per_step": used,
    }
    close_llm(llm)
    return result


def print_results(results: dict[str, Any]) -> None:
    headers = ["blocks outside window", "peak used", "mean used", "max running", "mean running"]
    headers += ["preemptions", "steps", "output tok/s"]
    keys = ("peak_blocks_used", "mean_blocks_used", "max_running_seqs", "mean_running_seqs")
    keys += ("preemptions", "steps", "output_tok_per_s")
    rows = [[name, *(r[key] for key in keys)] for name, r in results.items()]
    print_table(headers, rows)


def plot(results: dict[str, Any], path: Path) -> None:
    """KV blocks in use at each engine step, one line per setting, against the pool."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in results.items():
        ax.plot(r["used_per_step"], label=f"{name} ({r['output_tok_per_s']} tok/s)")
    pool = next(iter(results.values()))["pool_blocks"]
    ax.axhline(pool, color="grey", linestyle="--", label="pool")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks in use")
    ax.legend(title="blocks outside the window")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def span(text: str) -> tuple[int, int]:
        low, _, high = text.partition("-")
        return int(low), int(high or low)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a sliding-window checkpoint; default: a tiny random Mistral")
    p.add_argument("--window", type=int, default=512, help="the tiny model's sliding_window")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--prompt-lens", type=span, default=(2000, 4000), help="LOW-HIGH tokens")
    p.add_argument("--output-lens", type=span, default=(1000, 3000), help="LOW-HIGH tokens")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=1024, help="the fixed KV pool")
    p.add_argument("--swap-space", type=float, default=0.5, help="CPU swap pool, GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="chunk budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write results here, the PNG beside it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(save_tiny_mistral(Path(tmp), args.window, args.max_model_len))
        results = {name: run_setting(model, args, free, name) for name, free in SETTINGS.items()}
    print(
        f"{args.num_requests} requests, prompts {args.prompt_lens} and outputs "
        f"{args.output_lens} tokens, all at once; {args.model or 'tiny random Mistral'}, "
        f"window {args.window}, {args.num_gpu_blocks} blocks of {args.block_size}, fp32"
    )
    print_results(results)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"settings": results})
        plot(results, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
