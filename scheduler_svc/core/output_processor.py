"""Applies a step's samples to its groups: appends tokens, forks samples and beams, stops."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator

from pagedserve.step import SeqOutput
from scheduler_svc.core.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus


def beam_score(seq: Sequence, length_penalty: float) -> float:
    """Cumulative logprob normalised by output length, as transformers ranks beams."""
    return seq.cumulative_logprob / max(len(seq.output_token_ids), 1) ** length_penalty


def num_samples(group: SequenceGroup) -> int:
    """Tokens (or candidates) the executor must draw for each of the group's sequences."""
    params = group.sampling_params
    if params.max_tokens == 0:  # the prompt is only scored
        return 0
    if params.use_beam_search:
        return 2 * params.width
    first_step = len(group.seqs) == 1 and not group.seqs[0].output_token_ids
    return params.width if first_step else 1


class OutputProcessor:
    """Updates sequences after a step and frees whatever finished, within the same call."""

    def __init__(
        self,
        scheduler: Scheduler,
        eos_token_id: int | None,
        seq_ids: Iterator[int] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.eos_token_id = eos_token_id
        # Forks draw ids from the engine's counter; standalone, from far above prompt ids.
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count(1 << 40)

    def process(self, out: SchedulerOutput, samples: dict[int, SeqOutput]) -> list[SequenceGroup]:
        """Apply ``samples`` (by seq_id) to every scheduled group.

        Mutates sequences, the block manager (forks, frees) and the running queue.

        Returns:
            The groups that finished in this step.
        """
        for scheduled in out.scheduled:
            group = scheduled.group
            if group.needs_prompt_logprobs:  # one sequence: the prompt is not forked yet
                seq = group.get_seqs(SequenceStatus.RUNNING)[0]
                scored = samples[seq.seq_id].prompt_logprobs
                group.add_prompt_logprobs(seq.num_computed_tokens + 1, scored)
            if not self._count_computed(group):
                continue  # a prompt chunk: nothing was drawn
            if group.sampling_params.max_tokens == 0:
                self._finish_unsampled(group)
            elif group.sampling_params.use_beam_search:
                self._process_beams(group, samples)
            else:
                self._process_samples(group, samples)
        return self.scheduler.free_finished()

    def _finish_unsampled(self, group: SequenceGroup) -> None:
        """max_tokens 0: the prompt was scored, and each of the ``width`` outputs ends empty."""
        parent = group.seqs[0]
        for _ in range(group.sampling_params.width - 1):
            child = parent.fork(next(self._seq_ids))  # owns no blocks: it will never run
            child.status = SequenceStatus.FINISHED_LENGTH
            group.seqs.append(child)
        self.finish(parent, SequenceStatus.FINISHED_LENGTH)

    @staticmethod
    def can_process_run(out: SchedulerOutput) -> bool:
        """Whether ``process_run`` may apply the step: every group draws one sample per
        step, has no stop string (which needs the text after each token) and scores no
        prompt."""
        return all(
            s.group.sampling_params.width == 1
            and not s.group.sampling_params.use_beam_search
            and not s.group.sampling_params.stop
            and s.group.sampling_params.max_tokens > 0
            and not s.group.needs_prompt_logprobs
            for s in out.scheduled
        )

    def process_run(
        self, out: SchedulerOutput, outputs: dict[int, SeqOutput]
    ) -> list[SequenceGroup]:
        """Apply a call's tokens (one, or one per decode step in a row) sequence by
        sequence, each up to the token that stops it: what ``process`` does one step at a
        time, without a pass over every group per step. Only where ``can_process_run``.

        Mutates as ``process``; returns the groups that finished.
        """
        ended = False
        for scheduled in out.scheduled:
            group = scheduled.group
            if not self._count_computed(group):
                continue
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                drawn = outputs[seq.seq_id]
                tops = drawn.top_logprobs or [None] * len(drawn.token_ids)
                for i, (token_id, logprob, top) in enumerate(
                    zip(drawn.token_ids, drawn.logprobs, tops, strict=True)
                ):
                    if i > 0:  # the token drawn before went in at the next position
                        seq.num_computed_tokens = seq.get_len()
                    seq.append_token(token_id, logprob, top)
                    if self._check_stop(seq, group):
                        ended = True
                        break
        # Only sequences ended here leave: every other end left the queue where it happened.
        return self.scheduler.free_finished() if ended else []

    def _count_computed(self, group: SequenceGroup) -> bool:
        """Count the step's tokens of ``group`` as computed; False for a prompt chunk,
        which drew nothing."""
        computed = True
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            length = seq.get_len()
            seq.num_computed_tokens = min(self.block_manager.num_slots(seq), length)
            computed &= seq.num_computed_tokens == length
        return computed

    def _process_samples(self, group: SequenceGroup, samples: dict[int, SeqOutput]) -> None:
        for parent in group.get_seqs(SequenceStatus.RUNNING):
            drawn = samples[parent.seq_id]
            # Fork before the parent's own token goes in: children share its blocks.
            children = [self._fork(group, parent) for _ in drawn.token_ids[1:]]
            tops = drawn.top_logprobs or [None] * len(drawn.token_ids)
            for seq, token_id, logprob, top in zip(
                [parent, *children], drawn.token_ids, drawn.logprobs, tops, strict=True
            ):
                seq.append_token(token_id, logprob, top)
                self._check_stop(seq, group)

    def _process_beams(self, group: SequenceGroup, samples: dict[int, SeqOutput]) -> None:
        """Keep the best ``width`` continuations over all beams; park finished beams.

        Beams without a surviving continuation are freed at once (the paper's Figure 9).
        """
        params = group.sampling_params
        width = params.width
        candidates = sorted(
            (
                (parent.cumulative_logprob + logprob, parent, token_id, logprob)
                for parent in group.get_seqs(SequenceStatus.RUNNING)
                for token_id, logprob in zip(
                    samples[parent.seq_id].token_ids, samples[parent.seq_id].logprobs, strict=True
                )
            ),
            key=lambda c: -c[0],
        )
        picks: dict[int, list[tuple[int, float]]] = defaultdict(list)
        num_picked = 0
        for position, (_, parent, token_id, logprob) in enumerate(candidates):
            if num_picked == width:
                break
            if self._is_stop_token(token_id, params.ignore_eos, params.stop_token_ids):
                if position < width:
                    self._add_finished_beam(group, parent, token_id, logprob)
                continue
            picks[parent.seq_id].append((token_id, logprob))
            num_picked += 1
        for parent in group.get_seqs(SequenceStatus.RUNNING):
            chosen = picks[parent.seq_id]
            if not chosen:
                self._drop(group, parent)
                continue
            children = [self._fork(group, parent) for _ in chosen[1:]]
            for seq, (token_id, logprob) in zip([parent, *children], chosen, strict=True):
                seq.append_token(token_id, logprob)
        self._finish_beams_if_done(group)

    def _finish_beams_if_done(self, group: SequenceGroup) -> None:
        params = group.sampling_params
        running = group.get_seqs(SequenceStatus.RUNNING)
        finished = [s for s in group.seqs if s.status.is_finished]
        if running and len(running[0].output_token_ids) >= params.max_tokens:
            for seq in running:
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        elif running and len(finished) >= params.width:
            worst = min(beam_score(s, params.length_penalty) for s in finished)
            best = max(beam_score(s, params.length_penalty) for s in running)
            if best <= worst:  # no running beam can still beat a kept one
                for seq in running:
                    self._drop(group, seq)

    def _add_finished_beam(
        self, group: SequenceGroup, parent: Sequence, token_id: int, logprob: float
    ) -> None:
        """Record ``parent + token`` as a finished hypothesis, keeping the best ``width``."""
        params = group.sampling_params
        beam = parent.fork(next(self._seq_ids))  # owns no blocks: it will never run
        beam.append_token(token_id, logprob)
        beam.status = SequenceStatus.FINISHED_STOPPED
        group.seqs.append(beam)
        finished = [s for s in group.seqs if s.status.is_finished]
        if len(finished) > params.width:
            group.seqs.remove(min(finished, key=lambda s: beam_score(s, params.length_penalty)))

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self._seq_ids))
        self.block_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def _drop(self, group: SequenceGroup, seq: Sequence) -> None:
        self.block_manager.free(seq)
        group.seqs.remove(seq)

    def _check_stop(self, seq: Sequence, group: SequenceGroup) -> bool:
        """End ``seq`` at a stop token or its length limit; whether it ended."""
        params = group.sampling_params
        if self._is_stop_token(seq.output_token_ids[-1], params.ignore_eos, params.stop_token_ids):
            self.finish(seq, SequenceStatus.FINISHED_STOPPED)
            return True
        if (
            len(seq.output_token_ids) >= params.max_tokens
            or seq.get_len() >= self.scheduler.config.max_model_len
        ):
            self.finish(seq, SequenceStatus.FINISHED_LENGTH)
            return True
        return False

    def _is_stop_token(
        self, token_id: int, ignore_eos: bool, stop_token_ids: tuple[int, ...]
    ) -> bool:
        return (not ignore_eos and token_id == self.eos_token_id) or token_id in stop_token_ids

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence now and free its blocks (its group leaves with free_finished)."""
        seq.status = status
        self.block_manager.free(seq)
