"""The engine loop of one process: schedule, execute, apply outputs, repeat."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqStep, StepResult
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.detokenizer import Detokenizer, find_stop
from scheduler_svc.output_processor import OutputProcessor, num_samples
from scheduler_svc.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class EngineStats:
    """Counters since start, read by metrics and benchmarks."""

    num_steps: int = 0
    num_mixed_steps: int = 0  # steps holding prefill and decode sequences together
    num_prompt_tokens: int = 0  # prompt tokens computed (cached ones excluded)
    num_generation_tokens: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)  # by mode


@dataclass(slots=True)
class StepOutcome:
    """What one step changed: the groups it ran and those that ended (done or refused)."""

    groups: list[SequenceGroup] = field(default_factory=list)
    finished: list[SequenceGroup] = field(default_factory=list)
    text_deltas: dict[int, str] = field(default_factory=dict)  # seq_id -> new text


class StepExecutor(Protocol):
    """Anything that runs a step: the in-process executor or the gRPC client."""

    def execute(self, step: ExecuteStep) -> StepResult: ...


class LLMEngine:
    """Owns the scheduler and drives an executor one step at a time."""

    def __init__(
        self,
        executor: StepExecutor,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        eos_token_id: int | None,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.executor = executor
        self.detokenizer = detokenizer
        self.scheduler = Scheduler(scheduler_config, BlockManager.from_config(cache_config))
        self._seq_ids: Iterator[int] = itertools.count()
        self.processor = OutputProcessor(self.scheduler, eos_token_id, self._seq_ids)
        self._step_ids = itertools.count()
        self.epoch = 0
        self.stats = EngineStats()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> SequenceGroup:
        """Queue a request. Raises RequestRejectedError when it can never run."""
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, [seq], arrival, params)
        self.scheduler.add_seq_group(group)
        return group

    def abort(self, request_id: str) -> SequenceGroup | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepOutcome:
        """Run one step: schedule, execute, append tokens, detokenize, stop."""
        out = self.scheduler.schedule()
        outcome = StepOutcome(finished=list(out.ignored))
        if out.is_empty:
            return outcome
        step = self._build_step(out)
        result = self.executor.execute(step)
        self._count(out, step)
        samples = {o.seq_id: o for o in result.outputs}
        outcome.finished += self.processor.process(out, samples)
        outcome.groups = [s.group for s in out.scheduled]
        if self.detokenizer is not None:
            self._detokenize(outcome)
        return outcome

    def _detokenize(self, outcome: StepOutcome) -> None:
        """Extend each sequence's text; a completed stop string ends the sequence there."""
        stopped = False
        for group in outcome.groups:
            stop = group.sampling_params.stop
            for seq in group.seqs:
                if seq.read_offset == len(seq.output_token_ids):
                    continue
                delta = self.detokenizer.update(seq)
                cut = find_stop(seq.output_text, len(delta), stop) if stop and delta else None
                if cut is not None:
                    delta = delta[: max(0, len(delta) - (len(seq.output_text) - cut))]
                    seq.output_text = seq.output_text[:cut]
                    if not seq.status.is_finished:
                        self.processor.finish(seq, SequenceStatus.FINISHED_STOPPED)
                        stopped = True
                outcome.text_deltas[seq.seq_id] = delta
        if stopped:
            outcome.finished += self.scheduler.free_finished()

    def _count(self, out: SchedulerOutput, step: ExecuteStep) -> None:
        stats = self.stats
        stats.num_steps += 1
        kinds = {s.is_prefill for s in out.scheduled}
        stats.num_mixed_steps += len(kinds) == 2
        stats.num_prompt_tokens += sum(
            len(s.new_token_ids) for s in step.seqs if len(s.new_token_ids) > 1
        )
        stats.num_generation_tokens += sum(s.num_samples for s in step.seqs)
        for _, mode in out.preempted:
            stats.preemptions[mode.value] = stats.preemptions.get(mode.value, 0) + 1

    def _build_step(self, out: SchedulerOutput) -> ExecuteStep:
        bm = self.scheduler.block_manager
        seqs = []
        for scheduled in out.scheduled:
            group = scheduled.group
            params = group.sampling_params
            k = num_samples(group)
            history = params.has_penalties
            for index, seq in enumerate(group.seqs):
                if seq.status != SequenceStatus.RUNNING:
                    continue
                tokens = seq.get_token_ids()
                seqs.append(
                    SeqStep(
                        seq_id=seq.seq_id,
                        new_token_ids=tokens[seq.num_computed_tokens :],
                        num_computed_tokens=seq.num_computed_tokens,
                        block_table=list(bm.get_block_table(seq)),
                        sampling_params=params,
                        num_samples=k,
                        sample_index=index,
                        prompt_token_ids=seq.prompt_token_ids if history else [],
                        output_token_ids=seq.output_token_ids if history else [],
                    )
                )
        return ExecuteStep(
            step_id=next(self._step_ids),
            epoch=self.epoch,
            seqs=seqs,
            blocks_to_swap_out=out.blocks_to_swap_out,
            blocks_to_swap_in=out.blocks_to_swap_in,
            blocks_to_copy=out.blocks_to_copy,
        )
