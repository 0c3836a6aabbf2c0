"""Block size sweep (the paper's §7.2 and Figure 19): KV utilization and throughput by block
size, and what preempting one sequence costs by swap against recompute."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench.common import Trace, close_llm, pyplot, time_offline
from bench.memory_waste import replay_paged


@dataclass(frozen=True, slots=True)
class SweepConfig:
    model: str
    block_sizes: tuple[int, ...]
    kv_slots: int  # the same KV budget in token slots for every block size
    max_model_len: int
    swap_space: float  # GiB
    preempt_tokens: int  # context length of the preempted sequence
    repeats: int
    seed: int


def utilization(traces: dict[str, Trace], config: SweepConfig) -> dict[str, dict[int, Any]]:
    """Mean filled / allocated KV slots per block size: the real scheduler and block
    manager, one token per running sequence per step (no model)."""
    out: dict[str, dict[int, Any]] = {}
    for preset, trace in traces.items():
        out[preset] = {}
        for block_size in config.block_sizes:
            run = replay_paged(trace, block_size, config.kv_slots, config.max_model_len)
            out[preset][block_size] = run.summary()
    return out


def throughput_and_preemption(
    traces: dict[str, Trace], config: SweepConfig
) -> tuple[dict[str, dict[int, Any]], dict[int, Any]]:
    """Per block size, one model load: the real engine's throughput on each trace, then
    swap-out, swap-in and recompute of one ``preempt_tokens``-long sequence."""
    from pagedserve.offline import OfflineLLM
    from pagedserve.settings import ExecutorConfig

    throughput: dict[str, dict[int, Any]] = {preset: {} for preset in traces}
    preemption: dict[int, Any] = {}
    for block_size in config.block_sizes:
        executor_config = ExecutorConfig(
            model=config.model,
            dtype="float32",
            block_size=block_size,
            num_gpu_blocks=max(config.kv_slots // block_size, 1),
            swap_space=config.swap_space,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
        llm = OfflineLLM(executor_config)
        try:
            for preset, trace in traces.items():
                throughput[preset][block_size] = time_offline(llm, trace).summary()
            preemption[block_size] = time_preemption(llm.executor, config)
        finally:
            close_llm(llm)
        del llm
        gc.collect()
    return throughput, preemption


def time_preemption(executor: Any, config: SweepConfig) -> dict[str, float | int]:
    """Median milliseconds to swap a sequence's blocks out and in through the executor's
    step (its cache engine), and to recompute it: one prefill of all its tokens."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.step import ExecuteStep, SeqStep

    block_size = executor.cache.shape.block_size
    num_blocks = -(-config.preempt_tokens // block_size)
    if num_blocks > min(executor.cache.num_gpu_blocks, executor.cache.num_cpu_blocks):
        raise ValueError(f"{num_blocks} blocks of {block_size} exceed a pool: raise the pools")
    pairs = [(b, b) for b in range(num_blocks)]
    prompt = [100 + (i * 7919) % 40000 for i in range(config.preempt_tokens)]
    recompute = SeqStep(
        seq_id=0,
        new_token_ids=prompt,
        num_computed_tokens=0,
        block_table=list(range(num_blocks)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
    )
    steps = {
        "swap_out_ms": ExecuteStep(0, 0, [], blocks_to_swap_out=pairs),
        "swap_in_ms": ExecuteStep(0, 0, [], blocks_to_swap_in=pairs),
        "recompute_ms": ExecuteStep(0, 0, [recompute]),
    }
    out: dict[str, float | int] = {"num_blocks": num_blocks, "tokens": config.preempt_tokens}
    for name, step in steps.items():
        executor.execute(step)  # warm-up
        times = []
        for _ in range(config.repeats):
            start = time.perf_counter()
            executor.execute(step)
            times.append(time.perf_counter() - start)
        out[name] = round(statistics.median(times) * 1e3, 3)
    out["swap_ms"] = round(out["swap_out_ms"] + out["swap_in_ms"], 3)
    return out


def plot_sweep(result: dict[str, Any], path: Any, title: str) -> None:
    """Utilization and throughput against block size, one line per preset."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for preset, runs in result["utilization"].items():
        sizes = sorted(runs, key=int)
        left.plot(sizes, [runs[b]["utilization"] for b in sizes], "o-", label=preset)
    for preset, runs in result["throughput"].items():
        sizes = sorted(runs, key=int)
        right.plot(sizes, [runs[b]["output_tokens_per_s"] for b in sizes], "o-", label=preset)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.legend()
    left.set_ylabel("KV utilization (filled / allocated slots)")
    left.set_title("memory (simulated steps, real block manager)")
    right.set_ylabel("output tokens/s")
    right.set_title("throughput (real model)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_preemption(preemption: dict[Any, Any], path: Any, title: str) -> None:
    """The paper's Figure 19(a) shape: swap and recompute latency by block size."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = sorted(preemption, key=int)
    for key, label in (
        ("swap_out_ms", "swap out"),
        ("swap_in_ms", "swap in"),
        ("swap_ms", "swap out + in"),
        ("recompute_ms", "recompute"),
    ):
        ax.plot(sizes, [preemption[b][key] for b in sizes], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
