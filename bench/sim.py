"""pagedserve's real engine, scheduler and block manager driven without a model.

``SimulatedExecutor`` answers each step with made-up tokens and logprobs, so block tables,
forks, copy-on-write and preemptions are exactly the engine's while no K/V is computed.
Parallel sampling needs nothing more (samples diverge right after the prompt and EOS is
ignored, so which tokens come out does not change a single block). Beam search keeps and
drops beams by their logprobs, which here come from Gaussian logits over a small
pseudo-vocabulary: simulated, not a model's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from bench.common import Trace, progress
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, PreemptionMode, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqOutput, StepResult
from scheduler_svc.core.sequence import SequenceStatus
from scheduler_svc.engine.engine import LLMEngine

TOKEN_OFFSET = 100  # pseudo-token i is token id TOKEN_OFFSET + i: clear of special tokens


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The stand-in model's output distribution."""

    vocab: int = 256  # pseudo-tokens a step chooses among
    logit_std: float = 2.0  # spread of the Gaussian logits: larger = more peaked softmax
    seed: int = 0

    def describe(self) -> str:
        return (
            f"simulated executor: logprobs = log_softmax of N(0, {self.logit_std}^2) logits "
            f"over {self.vocab} pseudo-tokens, seed {self.seed}; engine, scheduler and block "
            "manager are pagedserve's own"
        )


class SimulatedExecutor:
    """A ``StepExecutor`` that computes nothing: each sequence gets its ``num_samples``
    best pseudo-tokens of a fresh random distribution, best first."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        self.num_steps = 0

    def execute(self, step: ExecuteStep) -> StepResult:
        self.num_steps += 1
        if not step.seqs:
            return StepResult(step.step_id, [])
        logits = self.rng.standard_normal((len(step.seqs), self.config.vocab))
        logits *= self.config.logit_std
        logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        order = np.argsort(-logprobs, axis=1)
        outputs = []
        for row, seq in enumerate(step.seqs):
            best = order[row, : seq.num_samples]
            token_ids = [int(i) + TOKEN_OFFSET for i in best]
            outputs.append(SeqOutput(seq.seq_id, token_ids, logprobs[row, best].tolist()))
        return StepResult(step.step_id, outputs)


def simulated_engine(
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    sim: SimConfig,
    max_num_seqs: int = 256,
    num_cpu_blocks: int = 0,
    preemption_mode: PreemptionMode | None = None,
) -> LLMEngine:
    """An LLMEngine over a SimulatedExecutor (no EOS token: lengths are max_tokens)."""
    cache = CacheConfig(
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks
    )
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(8192, max_model_len),
        max_model_len=max_model_len,
        preemption_mode=preemption_mode,
        num_decode_steps=1,  # the paper's accounting: blocks mapped one token at a time
    )
    return LLMEngine(SimulatedExecutor(sim), cache, scheduler, eos_token_id=None)


@dataclass(slots=True)
class BlockUsage:
    """Per engine step: distinct KV blocks the running sequences hold, and the blocks they
    would hold if no block were shared (every table its own copy of every block)."""

    physical: list[int] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)
    preemptions: int = 0

    def record(self, tables: list[list[int]]) -> None:
        self.physical.append(len({b for table in tables for b in table}))
        self.logical.append(sum(len(table) for table in tables))

    @property
    def saving(self) -> float:
        """Blocks saved by sharing over blocks without sharing, summed over the run."""
        return 1 - sum(self.physical) / sum(self.logical)

    def summary(self) -> dict[str, float | int]:
        return {
            "saving": round(self.saving, 4),
            "mean_blocks_shared": round(statistics.fmean(self.physical), 1),
            "mean_blocks_unshared": round(statistics.fmean(self.logical), 1),
            "peak_blocks_shared": max(self.physical),
            "peak_blocks_unshared": max(self.logical),
            "steps": len(self.physical),
            "preemptions": self.preemptions,
        }


def replay(
    engine: LLMEngine,
    trace: Trace,
    params: list[SamplingParams],  # one per request
    desc: str,
    id_prefix: str = "r",
) -> BlockUsage:
    """Queue every request at once and step to the end, recording block use each step.

    Works on any LLMEngine: over a SimulatedExecutor or over the real one (OfflineLLM's).
    """
    for i, (prompt, p) in enumerate(zip(trace.prompts, params, strict=True)):
        engine.add_request(f"{id_prefix}{i}", prompt, p, arrival_time=i)
    usage = BlockUsage()
    bm = engine.scheduler.block_manager
    with progress(trace.num_requests, desc) as bar:
        while engine.has_unfinished():
            outcome = engine.step()
            running = [
                bm.get_block_table(seq)
                for group in engine.scheduler.running
                for seq in group.get_seqs(SequenceStatus.RUNNING)
            ]
            if running:
                usage.record(running)
            bar.update(len(outcome.finished))
    usage.preemptions = sum(engine.stats.preemptions.values())
    return usage
