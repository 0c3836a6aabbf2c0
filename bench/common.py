"""Shared by the benchmarks: the trace, arrivals, run records, tables, result files, plots."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB_SIZE = 49152  # SmolLM2's; the tiny test models share it
PRESETS = tuple(workload.PRESETS)


@dataclass
class Trace:
    """The requests of one workload, in arrival order; outputs ignore EOS."""

    prompt_lens: list[int]
    output_lens: list[int]
    prompts: list[list[int]]

    def head(self, num_requests: int) -> Trace:
        """The first ``num_requests`` requests (peers too slow for the whole trace)."""
        n = num_requests
        return Trace(self.prompt_lens[:n], self.output_lens[:n], self.prompts[:n])

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def load_trace(
    preset: str, num_requests: int, max_model_len: int, seed: int, shared_prefix_len: int = 0
) -> Trace:
    """Requests from the workload generator (bench/workload.py), all arriving at once."""
    requests = workload.generate(
        preset, num_requests, VOCAB_SIZE, seed, max_model_len, shared_prefix_len
    )
    return Trace(
        [len(r.prompt_token_ids) for r in requests],
        [r.max_tokens for r in requests],
        [r.prompt_token_ids for r in requests],
    )


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process at ``rate`` requests/s.

    The gaps are one fixed draw of unit exponentials divided by the rate, so every rate
    replays the same requests in the same order, only compressed or stretched in time.
    """
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(1.0) / rate
        times.append(t)
    return times


@dataclass(slots=True)
class Run:
    """One timed generation run: wall time from first submission to last token."""

    num_requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # engine counters of the run

    def summary(self) -> dict[str, Any]:
        out = {
            "num_requests": self.num_requests,
            "wall_s": round(self.wall_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / self.wall_s, 2),
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / self.wall_s, 2),
        }
        return out | self.extra | ({"note": self.note} if self.note else {})


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def progress(total: int, desc: str, unit: str = "req") -> tqdm:
    """A progress bar on stderr, so stdout keeps only the summary table."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The systems' order in each of ``rounds``: as given, then reversed, and so on (A B C,
    C B A): this machine's speed drifts over minutes, and a drift linear in time then weighs
    on each system alike."""
    return [list(names) if i % 2 == 0 else list(names)[::-1] for i in range(rounds)]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """A plain aligned table: the first column and a last "note" column left, others right."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    note = headers[-1] == "note"
    if title:
        print(title)

    def line(row: Sequence[str]) -> str:
        middle = row[1:-1] if note else row[1:]
        parts = [row[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(middle, widths[1:], strict=False)]
        return "  ".join(parts + ([row[-1]] if note else [])).rstrip()

    print(line(list(headers)))
    for row in cells:
        print(line(row))


def median_ms(fn: Callable[[], Any], min_run_time: float) -> float:
    """Median over timed blocks after a warm-up; Timer synchronises CUDA around each block.
    Timed on torch's threads (Timer's default would be one)."""
    import torch
    from torch.utils import benchmark

    fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def machine() -> dict[str, Any]:
    """Where the figures were measured; results without it cannot be compared. The model
    name alone does not tell two generations of a vendor's CPU apart ("AMD EPYC" has been
    both a Zen 3 without AVX-512 and a Zen 5 with it here): family, model and the vector
    width torch picked do."""
    import torch

    info: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path, config: dict[str, Any], body: dict[str, Any]) -> None:
    """``{"config", "machine", **body}`` with paths as portable strings (see _portable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: _portable(v) for k, v in config.items()}
    result = {"config": config, "machine": machine(), **body}
    path.write_text(json.dumps(result, indent=2) + "\n")


def _portable(value: Any) -> Any:
    """A path as the results should carry it in the repository: relative to the checkout when
    it lies inside it (``bench/results/x.json``), else only its last three parts
    (``.../vllm-venv/bin/python``)."""
    if not isinstance(value, Path) and not (isinstance(value, str) and value.startswith("/")):
        return value
    path = Path(os.path.abspath(value))  # not resolve(): a venv python is a symlink
    if path.is_relative_to(ROOT):
        return os.path.relpath(path, ROOT)
    return str(Path("...", *path.parts[1:][-3:]))  # never the root: "/" would restart it


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def close_llm(llm: Any) -> None:
    """Release an OfflineLLM (worker processes where it has them) before the next loads."""
    close = getattr(llm, "close", None)
    if close is not None:
        close()


def engine_flags(args: Any) -> dict[str, Any]:
    """ExecutorConfig fields from a benchmark's flags, the same for the in-process engine
    and `pagedserve serve`: fp32 always."""
    names = ("model", "block_size", "num_gpu_blocks", "swap_space", "max_model_len")
    return {"dtype": "float32"} | {name: getattr(args, name) for name in names}


def greedy_requests(trace: Trace, prefix: str = "r") -> list[Any]:
    """The trace as OfflineLLM requests: greedy, exactly ``max_tokens`` each (EOS ignored)."""
    from pagedserve.offline import Request
    from pagedserve.sampling_params import SamplingParams

    pairs = zip(trace.prompts, trace.output_lens, strict=True)
    return [
        Request(
            f"{prefix}{i}",
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        )
        for i, (prompt, n) in enumerate(pairs)
    ]


WARMUP_PROMPT = list(range(1000, 1008))  # shares no block with any trace prompt


def time_offline(llm: Any, trace: Trace) -> Run:
    """Warm up on a short unrelated prompt, then time the whole trace submitted at once."""
    warmup = Trace([len(WARMUP_PROMPT)], [4], [WARMUP_PROMPT])
    llm.generate(greedy_requests(warmup, "warmup"), progress=False)
    requests = greedy_requests(trace)
    before = engine_counters(llm.engine)
    start = time.perf_counter()
    results = llm.generate(requests)
    wall = time.perf_counter() - start
    after = engine_counters(llm.engine)
    output_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    extra = {name: round(after[name] - before[name], 3) for name in after}
    return Run(trace.num_requests, wall, sum(trace.prompt_lens), output_tokens, extra=extra)


def engine_counters(engine: Any) -> dict[str, float]:
    """The engine's running totals that explain a throughput figure."""
    stats, counters = engine.stats, engine.scheduler.block_manager.counters
    return {
        "steps": stats.num_steps,
        "execute_s": stats.execute_seconds,  # in process: the executor's steps alone
        "prefill_tokens_computed": stats.num_prompt_tokens,
        "prefix_cache_hit_tokens": counters.prefix_cache_hits,
        "preemptions": sum(stats.preemptions.values()),
    }
