#!/usr/bin/env python3
"""Memory sharing and block size: the paper's §6.1-6.3 and §7.2 on pagedserve.

    parallel    parallel sampling n = 2, 4, 6 and beam search width 2, 4, 6: KV blocks the
                running sequences hold with sharing against the same tables unshared (the
                real engine, scheduler and block manager; by default a simulated executor,
                --executor model runs SmolLM2 instead)
    prefix      a shared system prompt (chat-prefix preset): throughput and prefill tokens
                computed with prefix caching off and on (real model, in-process engine); and
                what caching costs on traces that share nothing (--cost-preset)
    block-size  KV utilization (simulated steps, real block manager) and throughput (real
                model) by block size, and the latency of preempting one sequence by swap
                out + in against recompute (real executor: cache engine and forward pass)

    python bench/sharing.py --json bench/results/sharing.json

One JSON holds every part; each part also gets a PNG beside it (sharing_<part>.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench import block_size as sweep
from bench.common import (
    close_llm,
    load_trace,
    print_table,
    pyplot,
    time_offline,
    write_json,
)
from bench.sim import SimConfig, replay, simulated_engine
from pagedserve.sampling_params import SamplingParams

PARTS = ("parallel", "prefix", "block-size")
# Memory saved by sharing in the paper's Figure 10 (OPT-13B), percent: (smallest, largest).
PAPER_SAVING = {
    "parallel": {"alpaca": (6.1, 9.8), "sharegpt": (16.2, 30.5)},
    "beam": {"alpaca": (37.6, 55.2), "sharegpt": (44.3, 66.3)},
}


def sharing_params(kind: str, width: int, max_tokens: int) -> SamplingParams:
    """``n`` random samples, or beam search of that width; exactly ``max_tokens`` each."""
    if kind == "beam":
        return SamplingParams(
            n=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        )
    return SamplingParams(n=width, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)


def run_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """Block savings of parallel sampling and beam search on each preset."""
    sim = SimConfig(seed=args.seed)
    llm = _model_llm(args) if args.executor == "model" else None
    runs: dict[str, dict[str, Any]] = {}
    try:
        for preset in args.presets:
            trace = load_trace(preset, args.num_requests, args.max_model_len, args.seed)
            for kind in ("parallel", "beam"):
                for width in args.widths:
                    label = f"{kind} {width}"
                    engine = llm.engine if llm is not None else _sim_engine(args, sim)
                    params = [sharing_params(kind, width, n) for n in trace.output_lens]
                    usage = replay(engine, trace, params, f"{preset} {label}", f"{label}-")
                    runs.setdefault(preset, {})[label] = usage.summary()
    finally:
        if llm is not None:
            close_llm(llm)
    source = sim.describe() if llm is None else f"real model {args.model} (random-token prompts)"
    return {"runs": runs, "paper_saving_percent": PAPER_SAVING, "executor": source}


def _sim_engine(args: argparse.Namespace, sim: SimConfig) -> Any:
    return simulated_engine(args.block_size, 1 << 16, args.max_model_len, sim)


def _model_llm(args: argparse.Namespace, enable_prefix_caching: bool = False) -> Any:
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import EngineOptions, ExecutorConfig

    config = ExecutorConfig(
        model=args.model,
        dtype="float32",
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    return OfflineLLM(config, EngineOptions(enable_prefix_caching=enable_prefix_caching))


def print_parallel(result: dict[str, Any]) -> None:
    rows = []
    for preset, runs in result["runs"].items():
        for label, s in runs.items():
            paper = PAPER_SAVING[label.split()[0]].get(preset)
            row = [s["mean_blocks_shared"], s["mean_blocks_unshared"], 100 * s["saving"]]
            rows.append([f"{preset} {label}", *row, f"{paper[0]}-{paper[1]}" if paper else "-"])
    headers = ["workload", "blocks shared", "unshared", "saving %", "paper %"]
    print_table(headers, rows, f"KV blocks in use, mean over steps ({result['executor']})")


def plot_parallel(result: dict[str, Any], path: Path) -> None:
    """The paper's Figure 10 shape: saving by width, one bar per preset, paper range shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    presets = list(result["runs"])
    kinds = (("parallel", "parallel sampling"), ("beam", "beam search"))
    for ax, (kind, title) in zip(axes, kinds, strict=True):
        for j, preset in enumerate(presets):
            runs = result["runs"][preset]
            labels = [k for k in runs if k.startswith(kind)]
            xs = [i + j * 0.38 for i in range(len(labels))]
            color = f"C{j}"
            ax.bar(xs, [100 * runs[k]["saving"] for k in labels], 0.36, label=preset, color=color)
            if preset in PAPER_SAVING[kind]:
                lo, hi = PAPER_SAVING[kind][preset]
                ax.axhspan(lo, hi, color=color, alpha=0.15, label=f"paper, {preset}")
            ax.set_xticks([i + 0.19 for i in range(len(labels))], [k.split()[1] for k in labels])
        ax.set_title(title)
        ax.set_xlabel("n" if kind == "parallel" else "beam width")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KV memory saved by sharing (%)")
    fig.suptitle("Blocks saved by sharing (real block manager; executor: see JSON)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """chat-prefix with a shared system prompt, prefix caching off then on."""
    trace = load_trace(
        "chat-prefix",
        args.prefix_requests,
        args.max_model_len,
        args.seed,
        args.shared_prefix_len,
    )
    runs = {}
    for caching in (False, True):
        llm = _model_llm(args, enable_prefix_caching=caching)
        try:
            runs["on" if caching else "off"] = time_offline(llm, trace).summary()
        finally:
            close_llm(llm)
        del llm
    off, on = runs["off"], runs["on"]
    return {
        "runs": runs,
        "prefill_tokens_saved": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
        "speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "cost": run_prefix_cost(args),
    }


def run_prefix_cost(args: argparse.Namespace) -> dict[str, Any]:
    """What caching costs where nothing is shared: --cost-preset traces, caching off and on
    loaded side by side and timed in the order off on, on off (a new trace each round, so
    no round hits what the last one cached); throughput summed over the rounds."""
    llms = {"off": _model_llm(args), "on": _model_llm(args, enable_prefix_caching=True)}
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        for r in range(args.cost_rounds):
            trace = load_trace(
                args.cost_preset, args.cost_requests, args.max_model_len, args.seed + r
            )
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                runs[name].append(time_offline(llms[name], trace).summary())
    finally:
        for llm in llms.values():
            close_llm(llm)

    def total(name: str, key: str) -> float:
        return sum(run[key] for run in runs[name])

    tok_s = {n: total(n, "output_tokens") / total(n, "wall_s") for n in runs}
    return {
        "preset": args.cost_preset,
        "runs": runs,
        "output_tokens_per_s": tok_s,
        "cache_hit_tokens": total("on", "prefix_cache_hit_tokens"),
        "cost": 1 - tok_s["on"] / tok_s["off"],
    }


def print_prefix(result: dict[str, Any]) -> None:
    rows = [
        [
            f"prefix caching {name}",
            s["wall_s"],
            s["output_tokens_per_s"],
            s["prefill_tokens_computed"],
            s["prefix_cache_hit_tokens"],
        ]
        for name, s in result["runs"].items()
    ]
    headers = ["chat-prefix", "wall s", "out tok/s", "prefill computed", "cache hits"]
    print_table(headers, rows, "Shared system prompt (real model)")
    print(
        f"prefill tokens saved {result['prefill_tokens_saved']:.1%}, "
        f"throughput x{result['speedup']:.2f}"
    )
    cost = result["cost"]
    print(
        f"no shared prefix ({cost['preset']}, {len(cost['runs']['on'])} rounds): "
        f"{cost['output_tokens_per_s']['off']:.1f} out tok/s off, "
        f"{cost['output_tokens_per_s']['on']:.1f} on, cost {cost['cost']:+.1%} "
        f"({cost['cache_hit_tokens']:.0f} tokens hit)"
    )


def plot_prefix(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.6))
    names = list(result["runs"])
    runs = [result["runs"][n] for n in names]
    left.bar(names, [r["prefill_tokens_computed"] for r in runs], color=["C1", "C0"])
    left.set_ylabel("prefill tokens computed")
    right.bar(names, [r["output_tokens_per_s"] for r in runs], color=["C1", "C0"])
    right.set_ylabel("output tokens/s")
    for ax in (left, right):
        ax.set_xlabel("prefix caching")
    fig.suptitle("Shared system prompt (chat-prefix, real model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_block_size(args: argparse.Namespace) -> dict[str, Any]:
    config = sweep.SweepConfig(
        model=args.model,
        block_sizes=tuple(args.block_sizes),
        kv_slots=args.kv_slots,
        max_model_len=args.max_model_len,
        swap_space=args.swap_space,
        preempt_tokens=args.preempt_tokens,
        repeats=args.repeats,
        seed=args.seed,
    )

    def traces(presets: list[str], n: int) -> dict[str, Any]:
        return {p: load_trace(p, n, args.max_model_len, args.seed) for p in presets}

    util = sweep.utilization(traces(args.presets, args.num_requests), config)
    throughput, preemption = sweep.throughput_and_preemption(
        traces(args.sweep_presets, args.sweep_requests), config
    )
    return {"utilization": util, "throughput": throughput, "preemption": preemption}


def print_block_size(result: dict[str, Any]) -> None:
    rows = []
    for preset, runs in result["utilization"].items():
        tput = result["throughput"].get(preset, {})
        for b, s in runs.items():
            out = tput.get(b, {}).get("output_tokens_per_s")
            rows.append([f"{preset} {b}", 100 * s["utilization"], s["peak_concurrent"], out])
    headers = ["preset, block size", "KV util %", "peak running", "out tok/s"]
    print_table(headers, rows, "Block size sweep")
    rows = [
        [b, p["num_blocks"], p["swap_out_ms"], p["swap_in_ms"], p["swap_ms"], p["recompute_ms"]]
        for b, p in result["preemption"].items()
    ]
    title = f"Preempting one {next(iter(result['preemption'].values()))['tokens']}-token sequence"
    print_table(
        ["block size", "blocks", "swap out", "swap in", "swap ms", "recompute ms"], rows, title
    )


NOTES = {
    "parallel": "block counts from pagedserve's engine, scheduler and block manager; without "
    "sharing = every running sequence holding a private copy of each block in its table, on "
    "the same schedule; parallel-sampling counts do not depend on the tokens drawn (EOS "
    "ignored), beam-search counts depend on the executor's logprobs",
    "prefix": "real model, in-process engine, all requests submitted at once",
    "block-size": "KV utilization: simulated steps (one token per running sequence, no model) "
    "through the real scheduler and block manager, on one KV budget in token slots; "
    "throughput: real model; preemption: the real executor's cache engine (swap) and forward "
    "pass (recompute) — on a CPU executor both pools are host memory, so swap is a memcpy",
}
RUNNERS = {"parallel": run_parallel, "prefix": run_prefix, "block-size": run_block_size}


def report(part: str, result: dict[str, Any], json_path: Path | None) -> None:
    """Print a part's table; plot it beside the JSON."""
    print(f"\n== {part}: {NOTES[part]}")
    stem = None if json_path is None else json_path.with_suffix("")
    if part == "parallel":
        print_parallel(result)
        if stem:
            plot_parallel(result, Path(f"{stem}_parallel_beam.png"))
    elif part == "prefix":
        print_prefix(result)
        if stem:
            plot_prefix(result, Path(f"{stem}_prefix.png"))
    else:
        print_block_size(result)
        if stem:
            sweep.plot_sweep(result, Path(f"{stem}_block_size.png"), "Block size sweep")
            title = "Preemption cost by block size (real executor)"
            sweep.plot_preemption(result["preemption"], Path(f"{stem}_preemption.png"), title)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def words(text: str) -> list[str]:
    return text.split(",")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=words, default=list(PARTS), help=f"some of {PARTS}")
    p.add_argument("--presets", type=words, default=["alpaca", "sharegpt"])
    p.add_argument("--num-requests", type=int, default=100, help="parallel, utilization")
    p.add_argument("--widths", type=ints, default=[2, 4, 6], help="n and beam widths")
    p.add_argument("--executor", choices=["sim", "model"], default="sim", help="parallel part")
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--cost-preset", default="sharegpt", help="prefix: trace of the cost runs")
    p.add_argument("--cost-requests", type=int, default=32, help="prefix: requests a cost run")
    p.add_argument("--cost-rounds", type=int, default=2, help="prefix: cost rounds (off+on each)")
    p.add_argument("--block-sizes", type=ints, default=[8, 16, 32, 64, 128])
    p.add_argument("--sweep-presets", type=words, default=["alpaca", "sharegpt"])
    p.add_argument("--sweep-requests", type=int, default=32, help="throughput by block size")
    p.add_argument("--kv-slots", type=int, default=65536, help="KV budget of the sweep")
    p.add_argument("--preempt-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write results here, PNGs beside it")
    args = p.parse_args(argv)
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for part in PARTS:
        if part not in args.parts:
            continue
        results[part] = RUNNERS[part](args) | {"note": NOTES[part]}
        report(part, results[part], args.json)
        if args.json:  # after every part: a later failure keeps what was measured
            write_json(args.json, config, results)
    if args.json:
        print(f"\nwrote {args.json} and its PNGs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
