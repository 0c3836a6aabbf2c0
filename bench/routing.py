"""Prefix-aware routing against round robin over two executors.

The `chat-prefix` trace with two distinct system prompts (two traces of the workload generator,
seeds s and s + 1, interleaved) goes through one scheduler in front of two registered
executors, once per routing policy. Prefix-aware routing sends each system prompt to the
executor that already holds it, so its prefix cache hits; round robin splits each prompt's
requests over both executors, so each computes both prompts. Each request is sent once the
one before it has its first token (the order of routing is the trace's, and each finds the
prompts before it cached). Printed and written: prefix-cache hit rate (hit tokens / looked-up
prompt tokens, from the scheduler's /metrics), prefill tokens computed, wall time and output
tokens/s.

    python bench/routing.py --num-requests 16 --shared-prefix-len 512 --json OUT

Needs Redis: the one answering at --redis, else a private server started here on a free port.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    RESULTS,
    Trace,
    load_trace,
    print_table,
    progress,
    pyplot,
    write_json,
)
from bench.launch import free_port, redis_url, server

POLICIES = ("prefix", "round-robin")


def two_prompt_trace(args: argparse.Namespace) -> Trace:
    """Two system prompts' requests in the order A A B B A A ...: round robin over two
    executors then gives each executor both prompts."""
    half = args.num_requests // 2
    a, b = (
        load_trace("chat-prefix", half, args.max_model_len, seed, args.shared_prefix_len)
        for seed in (args.seed, args.seed + 1)
    )
    alternating = [(t, j + k) for j in range(0, half, 2) for t in (a, b) for k in (0, 1)]
    return Trace(
        [t.prompt_lens[j] for t, j in alternating],
        [t.output_lens[j] for t, j in alternating],
        [t.prompts[j] for t, j in alternating],
    )


@contextlib.contextmanager
def executors(args: argparse.Namespace, store: str, namespace: str) -> Iterator[None]:
    """Two registered executors, one core's worth of threads each."""
    procs, logs = [], []
    threads = max(1, (os.cpu_count() or 2) // 2)
    try:
        for _ in range(2):
            log = tempfile.NamedTemporaryFile("w+", prefix="bench-executor-", suffix=".log")  # noqa: SIM115
            cmd = [sys.executable, "-m", "pagedserve.cli", "executor", f"--port={free_port()}"]
            cmd += [f"--model={args.model}", f"--num-gpu-blocks={args.num_gpu_blocks}"]
            cmd += [f"--block-size={args.block_size}", f"--max-model-len={args.max_model_len}"]
            cmd += ["--dtype=float32", "--swap-space=0.25", "--metrics-port=0"]
            cmd += [f"--state-store={store}", f"--namespace={namespace}", "--drain-timeout=5"]
            env = dict(os.environ) | {"OMP_NUM_THREADS": str(threads)}
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )
            )
            logs.append(log)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def wait_for_executors(url: str, count: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while len(httpx.get(f"{url}/health", timeout=5).json().get("executors", [])) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} executors registered after {timeout} s")
        time.sleep(0.5)


def counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics, re.M)
    return float(match[1]) if match else 0.0


def run_policy(args: argparse.Namespace, trace: Trace, store: str, policy: str) -> dict[str, Any]:
    namespace = f"bench-routing-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "scheduler", f"--port={port}"]
    cmd += [f"--state-store={store}", f"--namespace={namespace}", f"--routing={policy}"]
    cmd += ["--enable-prefix-caching"]
    with executors(args, store, namespace), server(cmd, port, f"scheduler-{policy}") as url:
        wait_for_executors(url, 2)
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        bar = progress(trace.num_requests, policy)

        # Each request is sent once the one before it has its first token: it is routed
        # after that one, and finds that one's prompt in the prefix cache. Sent on a
        # timer instead, a loaded machine could reorder arrivals into A B A B, and round
        # robin then matched prefix routing's hits (a fresh-clone CI run, 0.586 each).
        started = [threading.Event() for _ in range(trace.num_requests)]

        def send(i: int) -> int:
            if i:
                started[i - 1].wait()
            body = {"model": model, "prompt": trace.prompts[i], "temperature": 0}
            body |= {"max_tokens": trace.output_lens[i], "ignore_eos": True, "stream": True}
            body |= {"stream_options": {"include_usage": True}}
            tokens = 0
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            started[i].set()
                            usage = json.loads(line[6:]).get("usage")
                            tokens = usage["completion_tokens"] if usage else tokens
            finally:
                started[i].set()  # a failed request must not hold the others back
            bar.update()
            return tokens

        start = time.perf_counter()
        with ThreadPoolExecutor(trace.num_requests) as pool:
            output_tokens = sum(pool.map(send, range(trace.num_requests)))
        wall = time.perf_counter() - start
        bar.close()
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    queries = counter(metrics, "pagedserve_prefix_cache_queries_total")
    hits = counter(metrics, "pagedserve_prefix_cache_hits_total")
    return {
        "wall_s": round(wall, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefill_tokens_computed": int(queries - hits),
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = list(results)
    left.bar(names, [results[n]["prefix_hit_rate"] for n in names], color=["C0", "C1"])
    left.set_ylabel("prefix-cache hit rate")
    left.set_ylim(0, 1)
    right.bar(names, [results[n]["output_tokens_per_s"] for n in names], color=["C0", "C1"])
    right.set_ylabel("output tokens/s")
    fig.suptitle("Two executors, two system prompts (chat-prefix)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--num-requests", type=int, default=16, help="a multiple of 4: half per system prompt"
    )
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--json", type=Path, default=RESULTS / "routing_chat_prefix.json")
    p.add_argument("--plot", type=Path, default=None, help="default: the JSON path as .png")
    args = p.parse_args(argv)
    if args.num_requests < 4 or args.num_requests % 4:
        p.error("--num-requests must be a multiple of 4")
    trace = two_prompt_trace(args)
    with redis_url(args.redis) as store:
        results = {policy: run_policy(args, trace, store, policy) for policy in POLICIES}
    rows = [
        [
            policy,
            r["prefix_hit_rate"],
            r["prefill_tokens_computed"],
            r["wall_s"],
            r["output_tokens_per_s"],
        ]
        for policy, r in results.items()
    ]
    print_table(
        ["routing", "hit rate", "prefill computed", "wall s", "out tok/s"],
        rows,
        f"{trace.num_requests} chat-prefix requests, 2 system prompts of "
        f"{args.shared_prefix_len} tokens, 2 executors",
    )
    base = results["round-robin"]["output_tokens_per_s"]
    print(f"prefix / round-robin throughput: {results['prefix']['output_tokens_per_s'] / base:.2f}")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    write_json(args.json, config, {"systems": results})
    plot(results, args.plot or args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
