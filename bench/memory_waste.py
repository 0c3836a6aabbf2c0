#!/usr/bin/env python3
"""KV-cache memory waste: the paged block manager against contiguous pre-allocation.

Replays a trace from the workload generator (bench/workload.py), step by step (one token
per running request per step, FCFS admission), through pagedserve's real scheduler and
block manager and through three Orca-style contiguous allocators on the same KV budget:

    orca_max     reserves max_model_len slots per request
    orca_pow2    reserves prompt + the next power of two >= the output length
    orca_oracle  reserves prompt + the exact output length

Effective utilization = token slots holding real tokens / slots reserved, averaged over
the steps of the run. Contiguous reservations are placed first-fit in one address space,
so external fragmentation delays admission just as it would on a device.

    python bench/memory_waste.py --preset sharegpt --num-requests 200 --block-size 16 \\
        --json bench/results/memory_waste_sharegpt.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tqdm import tqdm

from bench.common import PRESETS, Trace, load_trace, pyplot, write_json
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import PreemptionMode, SchedulerConfig
from pagedserve.step import SeqOutput
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class RunResult:
    utilization: list[float] = field(default_factory=list)  # per step
    concurrent: list[int] = field(default_factory=list)  # per step
    preemptions: int = 0

    def summary(self) -> dict[str, float | int]:
        return {
            "utilization": round(statistics.fmean(self.utilization), 4),
            "peak_concurrent": max(self.concurrent),
            "mean_concurrent": round(statistics.fmean(self.concurrent), 2),
            "steps": len(self.concurrent),
            "preemptions": self.preemptions,
        }


def replay_paged(trace: Trace, block_size: int, kv_slots: int, max_model_len: int) -> RunResult:
    """Run the trace through the real scheduler; the executor is a stand-in emitting token 1."""
    block_manager = BlockManager(block_size, kv_slots // block_size, 0, watermark=0.01)
    config = SchedulerConfig(
        max_num_seqs=len(trace.prompts),
        max_num_batched_tokens=max(8192, max_model_len),
        max_model_len=max_model_len,
        preemption_mode=PreemptionMode.RECOMPUTE,
        num_decode_steps=1,  # blocks mapped one token at a time, as the paper counts them
    )
    scheduler = Scheduler(config, block_manager)
    processor = OutputProcessor(scheduler, eos_token_id=None)
    for i, (prompt, output_len) in enumerate(zip(trace.prompts, trace.output_lens, strict=True)):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_seq_group(SequenceGroup(f"r{i}", [Sequence(i, list(prompt))], i, params))
    result = RunResult()
    with tqdm(total=len(trace.prompts), desc="paged", unit="req", file=sys.stderr) as bar:
        while scheduler.has_unfinished():
            out = scheduler.schedule()
            result.preemptions += len(out.preempted)
            result.utilization.append(block_manager.slot_utilization())
            result.concurrent.append(len(scheduler.running))
            seqs = [s for g in out.scheduled for s in g.group.get_seqs(SequenceStatus.RUNNING)]
            samples = {seq.seq_id: SeqOutput(seq.seq_id, [1], [0.0]) for seq in seqs}
            bar.update(len(processor.process(out, samples)))
    return result


class FirstFit:
    """Contiguous reservations in one address space of ``capacity`` slots."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.spans: dict[int, tuple[int, int]] = {}  # request -> (start, size)

    def reserve(self, request: int, size: int) -> bool:
        start = 0
        for span_start, span_size in sorted(self.spans.values()):
            if span_start - start >= size:
                break
            start = max(start, span_start + span_size)
        if start + size > self.capacity:
            return False
        self.spans[request] = (start, size)
        return True

    def release(self, request: int) -> None:
        del self.spans[request]


def replay_contiguous(trace: Trace, reserve: list[int], kv_slots: int, name: str) -> RunResult:
    """Iteration-level batching with per-request contiguous reservations, FCFS admission."""
    space = FirstFit(kv_slots)
    waiting = list(range(len(trace.prompts)))
    generated: dict[int, int] = {}  # running request -> tokens generated so far
    result = RunResult()
    with tqdm(total=len(waiting), desc=name, unit="req", file=sys.stderr) as bar:
        while waiting or generated:
            while waiting and space.reserve(waiting[0], reserve[waiting[0]]):
                generated[waiting.pop(0)] = 0
            if not generated:
                raise ValueError(f"{name}: a request reserves more than the whole KV budget")
            stored = sum(trace.prompt_lens[r] + g for r, g in generated.items())
            result.utilization.append(stored / sum(reserve[r] for r in generated))
            result.concurrent.append(len(generated))
            for request in list(generated):
                generated[request] += 1
                if generated[request] == trace.output_lens[request]:
                    del generated[request]
                    space.release(request)
                    bar.update()
    return result


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plot(runs: dict[str, RunResult], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        ax.plot(run.utilization, label=f"{name} (mean {statistics.fmean(run.utilization):.1%})")
    ax.set_xlabel("engine step")
    ax.set_ylabel("effective KV utilization (filled / reserved slots)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="sharegpt", choices=PRESETS)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-slots", type=int, default=32768, help="KV budget in token slots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here (and a PNG beside it)")
    args = parser.parse_args(argv)

    trace = load_trace(args.preset, args.num_requests, args.max_model_len, args.seed)
    pairs = list(zip(trace.prompt_lens, trace.output_lens, strict=True))
    runs = {
        "paged": replay_paged(trace, args.block_size, args.kv_slots, args.max_model_len),
        "orca_max": replay_contiguous(
            trace, [args.max_model_len] * len(pairs), args.kv_slots, "orca_max"
        ),
        "orca_pow2": replay_contiguous(
            trace, [p + next_pow2(o) for p, o in pairs], args.kv_slots, "orca_pow2"
        ),
        "orca_oracle": replay_contiguous(
            trace, [p + o for p, o in pairs], args.kv_slots, "orca_oracle"
        ),
    }
    systems = {name: run.summary() for name, run in runs.items()}
    print(
        f"{args.preset}: {args.num_requests} requests, block size {args.block_size}, "
        f"{args.kv_slots} KV slots, max model len {args.max_model_len}"
    )
    print(f"{'system':<12} {'utilization':>11} {'peak conc.':>10} {'mean conc.':>10} {'steps':>6}")
    for name, s in systems.items():
        print(
            f"{name:<12} {s['utilization']:>11.1%} {s['peak_concurrent']:>10} "
            f"{s['mean_concurrent']:>10} {s['steps']:>6}"
        )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, config, {"systems": systems})
        plot(runs, args.json.with_suffix(".png"), f"{args.preset}, block size {args.block_size}")
        print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
