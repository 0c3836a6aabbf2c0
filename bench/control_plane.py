#!/usr/bin/env python3
"""Control-plane overhead: how busy the scheduler keeps an executor whose steps are fast.

A stand-in executor (bench/standin_executor.py: the real gRPC server, step ledger and
cache operations; a forward pass that sleeps a fixed time) behind the real scheduler with
Redis journaling and its HTTP front door. A load keeps N sequences running (long
``max_tokens``, EOS ignored; a finished one is replaced at once). Over a steady window:

* busy fraction: the executor's time inside steps (GetStats) / wall time;
* forward fraction: decode steps x the step time / wall time, what an accelerator with
  exactly that step time would compute (busy also counts the executor's Python between
  the passes of a call, and sleeps that overran);
* decode steps/s: tokens generated per second / N; calls/s: Execute calls per second;
* gap: wall time outside steps per call, split into the executor's own work between two
  passes (judging a call, filling in its followers, recording it: own) and the rest
  (late: the next call had not come yet, or was still being read);
* the scheduler process's CPU time (user + system, /proc) per call and per decode step;
* sched bound: time inside steps / the scheduler's CPU time, the busy fraction that its
  CPU per call allows even with a core to itself (its threads share one interpreter lock).

Once with one step a call, once with decode steps in a row (--num-decode-steps, with no
quiet period after arrivals unless --decode-steps-quiet sets one), each with async
scheduling (the next call sent while one runs) and without:

    python bench/control_plane.py --step-ms 2,5,10 --seqs 32,128,256 \\
        --json bench/results/control_plane.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.common import VOCAB_SIZE, print_table, progress, pyplot, write_json
from bench.launch import free_port, healthy, process, redis_url
from pagedserve.settings import SERVING_COMMIT_INTERVAL_S, SERVING_DECODE_STEPS_QUIET_S
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorUnavailable
from tests.redis_server import delete_namespace

TARGETS = {"one_step": 0.90, "steps_in_a_row": 0.95}  # busy fraction at 5 ms, 256 seqs
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Sample:
    """Running totals at one instant."""

    at: float  # perf_counter seconds
    busy_s: float  # executor: time inside steps
    own_s: float  # executor: its thread's time around steps, outside them
    calls: int  # executor: Execute calls applied
    scheduler: Counters
    scheduler_cpu_s: float
    executor_cpu_s: float
    client_cpu_s: float


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


@dataclass(frozen=True, slots=True)
class Counters:
    """The scheduler's /metrics figures a window needs."""

    tokens: float = 0.0  # generated
    running: int = 0  # requests running now
    ended: float = 0.0  # requests ended (each replaced at once by the load)
    ttft_sum_s: float = 0.0  # their times to first token, summed
    ttft_count: float = 0.0


def scheduler_counters(text: str) -> Counters:
    values: dict[str, float] = {"ended": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagedserve_generation_tokens_total":
                values["tokens"] = s.value
            elif s.name == "pagedserve_num_requests" and s.labels.get("state") == "running":
                values["running"] = int(s.value)
            elif s.name == "pagedserve_requests_total":
                values["ended"] += s.value
            elif s.name == "pagedserve_time_to_first_token_seconds_sum":
                values["ttft_sum_s"] = s.value
            elif s.name == "pagedserve_time_to_first_token_seconds_count":
                values["ttft_count"] = s.value
    return Counters(**values)


@dataclass(frozen=True, slots=True)
class Processes:
    """The stand-in executor (its client and pid) and the scheduler (its URL and pid)."""

    executor: ExecutorClient
    executor_pid: int
    url: str
    scheduler_pid: int


async def sample(http: httpx.AsyncClient, procs: Processes) -> Sample:
    stats = await asyncio.to_thread(procs.executor.get_stats)
    counters = scheduler_counters((await http.get("/metrics")).text)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return Sample(
        time.perf_counter(),
        stats.total_step_seconds,
        stats.total_overhead_seconds,
        stats.num_steps,
        counters,
        cpu_seconds(procs.scheduler_pid),
        cpu_seconds(procs.executor_pid),
        usage.ru_utime + usage.ru_stime,
    )


def figures(a: Sample, b: Sample, num_seqs: int, step_ms: float) -> dict[str, Any]:
    """What the window between two samples shows. ``forward_fraction`` is the share of the
    wall time an accelerator whose forward pass takes exactly ``step_ms`` would compute:
    ``busy_fraction`` also counts the executor's own Python between the passes of a call
    and a sleep that overran on a loaded machine. ``scheduler_bound`` is the busy fraction
    a scheduler with a whole core to itself could give at its CPU per call: its Python
    runs under one lock (the GIL), so it issues at most one call per that much CPU."""
    wall, calls = b.at - a.at, b.calls - a.calls
    decode_steps = (b.scheduler.tokens - a.scheduler.tokens) / num_seqs
    first_tokens = b.scheduler.ttft_count - a.scheduler.ttft_count
    ttft_s = b.scheduler.ttft_sum_s - a.scheduler.ttft_sum_s
    cpu = b.scheduler_cpu_s - a.scheduler_cpu_s
    busy, own = b.busy_s - a.busy_s, b.own_s - a.own_s
    return {
        "window_s": round(wall, 3),
        "calls": calls,
        "decode_steps": round(decode_steps, 1),
        "busy_fraction": round(busy / wall, 4),
        "forward_fraction": round(decode_steps * step_ms / 1e3 / wall, 4),
        "decode_steps_per_s": round(decode_steps / wall, 1),
        "calls_per_s": round(calls / wall, 1),
        "gap_ms_per_call": round((wall - busy) / calls * 1e3, 3) if calls else None,
        "executor_own_ms_per_call": round(own / calls * 1e3, 3) if calls else None,
        "late_ms_per_call": round((wall - busy - own) / calls * 1e3, 3) if calls else None,
        "scheduler_cpu_ms_per_call": round(cpu / calls * 1e3, 3) if calls else None,
        "scheduler_cpu_ms_per_decode_step": (
            round(cpu / decode_steps * 1e3, 3) if decode_steps else None
        ),
        "scheduler_cpu_cores": round(cpu / wall, 3),
        "scheduler_bound": round(min(1.0, busy / cpu), 4) if cpu else None,
        "executor_cpu_ms_per_call": (
            round((b.executor_cpu_s - a.executor_cpu_s) / calls * 1e3, 3) if calls else None
        ),
        "client_cpu_cores": round((b.client_cpu_s - a.client_cpu_s) / wall, 3),
        "arrivals_per_s": round((b.scheduler.ended - a.scheduler.ended) / wall, 1),
        "ttft_mean_ms": round(ttft_s / first_tokens * 1e3, 1) if first_tokens else None,
        "running_at_end": b.scheduler.running,
    }


class Load:
    """Keeps a number of requests running: each slot sends a request and, when it ends,
    the next one, over a connection of its own. (Through one shared client, httpx's pool
    matched each request against every connection: with 256 slots whose requests end
    together, the load itself took most of a core.)"""

    def __init__(self, url: str, model: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.body = {"model": model, "ignore_eos": True}
        self.body["temperature"] = 0.0
        self.rng = random.Random(args.seed)
        self.prefix = [self.rng.randrange(1000, VOCAB_SIZE) for _ in range(args.shared_prefix)]
        self.slots: list[asyncio.Task] = []

    def grow(self, num_seqs: int) -> None:
        while len(self.slots) < num_seqs:
            self.slots.append(asyncio.create_task(self._slot()))

    def prompt(self) -> list[int]:
        """The next prompt: the shared prefix, then tokens drawn for it alone."""
        num_drawn = self.args.prompt_len - len(self.prefix)
        return self.prefix + [self.rng.randrange(1000, VOCAB_SIZE) for _ in range(num_drawn)]

    async def _slot(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=None) as http:
            while True:
                prompt = self.prompt()
                low = self.args.min_tokens or self.args.max_tokens
                body = {"prompt": prompt, "max_tokens": self.rng.randint(low, self.args.max_tokens)}
                response = await http.post("/v1/completions", json=self.body | body)
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    def check(self) -> None:
        """Raise the failure of a slot, if one failed."""
        for task in self.slots:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def stop(self) -> None:
        for task in self.slots:
            task.cancel()
        await asyncio.gather(*self.slots, return_exceptions=True)


async def measure_levels(
    procs: Processes, args: argparse.Namespace, step_ms: float, bar: Any
) -> list[dict]:
    """Grow the load through ``args.seqs``; at each level wait until all run, let it settle,
    then sample a window."""
    async with httpx.AsyncClient(base_url=procs.url, timeout=None) as http:
        load = Load(procs.url, (await http.get("/v1/models")).json()["data"][0]["id"], args)
        results = []
        try:
            for num_seqs in args.seqs:
                load.grow(num_seqs)
                while (await sample(http, procs)).scheduler.running < num_seqs:
                    load.check()
                    await asyncio.sleep(0.05)
                await asyncio.sleep(args.warmup)
                first = await sample(http, procs)
                await asyncio.sleep(args.window)
                last = await sample(http, procs)
                load.check()
                results.append({"num_seqs": num_seqs} | figures(first, last, num_seqs, step_ms))
                bar.update(1)
        finally:
            await load.stop()
    return results


@contextlib.contextmanager
def standin_executor(
    args: argparse.Namespace, step_ms: float
) -> Iterator[tuple[ExecutorClient, int]]:
    """bench/standin_executor.py on a free port; yields a client of it and its pid."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.standin_executor", f"--port={port}"]
    cmd += [
        f"--step-ms={step_ms}",
        f"--model={args.model}",
        f"--max-model-len={args.max_model_len}",
    ]
    cmd.append(f"--num-gpu-blocks={args.num_gpu_blocks}")
    with ExecutorClient(f"127.0.0.1:{port}") as client:

        def answers() -> bool:
            with contextlib.suppress(ExecutorUnavailable):
                return bool(client.health(timeout=1))
            return False

        with process(cmd, "standin-executor", answers) as proc:
            yield client, proc.pid


@contextlib.contextmanager
def scheduler(
    args: argparse.Namespace,
    executor: str,
    store: str,
    num_decode_steps: int,
    async_scheduling: bool,
) -> Iterator[tuple[str, int]]:
    """`pagedserve scheduler` journaling to ``store``, decode steps in a row once no request
    arrived for --decode-steps-quiet (0: from the first step), as many as asked however
    long a step takes (no --decode-steps-span), every sequence admitted (no
    pacing, no queue-wait bound: the batch sizes are the experiment's, and each level
    arrives as one burst); yields its URL and process id. The requests it leaves running
    are deleted from the store with it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    namespace = f"control-plane-{port}"
    cmd = [sys.executable, "-m", "pagedserve.cli", "scheduler", f"--executor={executor}"]
    cmd += [f"--state-store={store}", f"--namespace={namespace}", f"--port={port}"]
    cmd += [f"--max-num-seqs={max(args.seqs)}", f"--num-decode-steps={num_decode_steps}"]
    cmd += [f"--decode-steps-quiet={args.decode_steps_quiet}", "--decode-steps-span=0"]
    cmd += ["--max-token-slowdown=0", "--max-queue-wait=0"]
    cmd.append("--async-scheduling" if async_scheduling else "--no-async-scheduling")
    cmd.append(f"--commit-interval={args.commit_interval}")
    try:
        with process(cmd, "scheduler", lambda: healthy(url)) as proc:
            yield url, proc.pid
    finally:
        with redis.Redis.from_url(store) as client:
            delete_namespace(client, namespace)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    total = len(args.step_ms) * len(args.decode_steps) * len(args.scheduling) * len(args.seqs)
    with redis_url(args.redis) as store, progress(total, "configurations", "cfg") as bar:
        for step_ms in args.step_ms:
            for k in args.decode_steps:
                for scheduling in args.scheduling:
                    ahead = scheduling == "async"
                    with (
                        standin_executor(args, step_ms) as (executor, executor_pid),
                        scheduler(args, executor.address, store, k, ahead) as (url, sched_pid),
                    ):
                        procs = Processes(executor, executor_pid, url, sched_pid)
                        levels = asyncio.run(measure_levels(procs, args, step_ms, bar))
                    config = {"step_ms": step_ms, "num_decode_steps": k, "scheduling": scheduling}
                    runs += [config | r for r in levels]
    return runs


def mode_name(num_decode_steps: int, scheduling: str) -> str:
    calls = "one step a call" if num_decode_steps == 1 else f"{num_decode_steps} steps in a row"
    return f"{calls}, {scheduling}"


def print_results(runs: list[dict[str, Any]]) -> None:
    headers = ["step ms", "calls", "seqs", "busy", "forward", "decode steps/s", "calls/s"]
    headers += ["gap ms/call", "own ms/call", "late ms/call"]
    headers += ["sched CPU ms/call", "sched CPU ms/decode step", "sched cores", "sched bound"]
    headers += ["executor CPU ms/call", "client cores", "arrivals/s", "TTFT mean ms"]
    rows = [
        [
            r["step_ms"],
            mode_name(r["num_decode_steps"], r["scheduling"]),
            r["num_seqs"],
            r["busy_fraction"],
            r["forward_fraction"],
            r["decode_steps_per_s"],
            r["calls_per_s"],
            r["gap_ms_per_call"],
            r["executor_own_ms_per_call"],
            r["late_ms_per_call"],
            r["scheduler_cpu_ms_per_call"],
            r["scheduler_cpu_ms_per_decode_step"],
            r["scheduler_cpu_cores"],
            r["scheduler_bound"],
            r["executor_cpu_ms_per_call"],
            r["client_cpu_cores"],
            r["arrivals_per_s"],
            r["ttft_mean_ms"],
        ]
        for r in runs
    ]
    print_table(headers, rows)


def _key(run: dict[str, Any]) -> tuple[int, str, float]:
    return run["num_decode_steps"], run["scheduling"], run["step_ms"]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Busy and forward fractions against running sequences: one panel per mode and
    scheduling, a colour per step time, the issue's target as a dashed line."""
    plt = pyplot()
    modes = sorted({(r["num_decode_steps"], r["scheduling"]) for r in runs})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, (k, scheduling) in zip(axes[0], modes, strict=True):
        for step_ms in sorted({r["step_ms"] for r in runs}):
            key = (k, scheduling, step_ms)
            points = [r for r in runs if _key(r) == key]
            xs = [r["num_seqs"] for r in points]
            line = ax.plot(xs, [r["busy_fraction"] for r in points], marker="o")[0]
            line.set_label(f"{step_ms:g} ms: busy")
            forward = [r["forward_fraction"] for r in points]
            ax.plot(xs, forward, ":", marker="x", color=line.get_color(), label="forward")
        target = TARGETS["one_step" if k == 1 else "steps_in_a_row"]
        ax.axhline(target, linestyle="--", color="grey", label=f"target {target:.2f} (5 ms)")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("running sequences")
        ax.set_ylabel("fraction of wall time")
        ax.set_title(mode_name(k, scheduling))
        ax.legend(title="step time", fontsize="x-small", title_fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", default="2,5,10", help="stand-in forward pass times, ms")
    p.add_argument("--seqs", default="32,128,256", help="running sequences, in rising order")
    p.add_argument(
        "--decode-steps", default="1,8", help="--num-decode-steps of the scheduler's runs"
    )
    p.add_argument(
        "--scheduling",
        default="async,sync",
        help="async: the next call sent while one runs (the default); sync: one at a time",
    )
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    p.add_argument("--window", type=float, default=5.0, help="seconds measured per level")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of each prompt")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens every prompt begins with, as a chat load's system prompt (prefix-cache "
        "hits: each admission makes the next commit write every group)",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens of each request")
    p.add_argument(
        "--min-tokens",
        type=int,
        help="each request's tokens drawn between this and --max-tokens: the requests then end "
        "at different times and their replacements arrive throughout the window (by default "
        "all have --max-tokens, and a level's burst ends together, after its window)",
    )
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="its tokenizer and limits")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-gpu-blocks", type=int, default=65536)
    p.add_argument(
        "--commit-interval",
        type=float,
        default=SERVING_COMMIT_INTERVAL_S,
        help="the scheduler's --commit-interval, seconds (default: a server's); 0: every call",
    )
    p.add_argument(
        "--decode-steps-quiet",
        type=float,
        default=0.0,
        help="the scheduler's --decode-steps-quiet: seconds without an arrival before a call "
        "runs decode steps in a row (0: at once; a server's default is "
        f"{SERVING_DECODE_STEPS_QUIET_S:g})",
    )
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="else a private one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write results here, the PNG beside it")
    args = p.parse_args(argv)
    args.step_ms = [float(v) for v in args.step_ms.split(",")]
    args.seqs = [int(v) for v in args.seqs.split(",")]
    args.decode_steps = [int(v) for v in args.decode_steps.split(",")]
    args.scheduling = args.scheduling.split(",")
    if not set(args.scheduling) <= {"async", "sync"}:
        p.error("--scheduling takes async, sync or both")
    if not 0 <= args.shared_prefix <= args.prompt_len:
        p.error("--shared-prefix must be between 0 and --prompt-len")
    if args.seqs != sorted(args.seqs):
        p.error("--seqs must rise: each level adds sequences to the running ones")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = run(args)
    print(
        f"stand-in executor (sleeping forward pass) behind the scheduler with Redis journaling; "
        f"{args.prompt_len}-token prompts ({args.shared_prefix} of them shared), "
        f"{args.max_tokens} tokens each, EOS ignored; "
        f"{args.window:g} s windows"
    )
    print_results(runs)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"targets": TARGETS, "runs": runs})
        plot(runs, args.json.with_suffix(".png"))
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
