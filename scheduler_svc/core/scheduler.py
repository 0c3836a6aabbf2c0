"""The FCFS scheduler: continuous batching with all-or-nothing preemption (paper §4.5),
and chunked prefill: long prompts share each step's token budget with running decodes."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import PreemptionMode, SchedulerConfig
from scheduler_svc.core.block_manager import AllocStatus, BlockManager, BlockMapping
from scheduler_svc.core.pace import TokenPace
from scheduler_svc.core.sequence import SequenceGroup, SequenceStatus


class RequestRejectedError(ValueError):
    """A request that can never be served with this model length or KV pool."""


@dataclass(slots=True)
class ScheduledGroup:
    """A group in this step; each running sequence computes tokens
    ``[num_computed_tokens, get_len())`` through its block table."""

    group: SequenceGroup
    is_prefill: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache this step


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step: what runs, and the cache operations the executor applies first."""

    scheduled: list[ScheduledGroup] = field(default_factory=list)
    blocks_to_swap_out: BlockMapping = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: BlockMapping = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: BlockMapping = field(default_factory=list)  # (src, dst) on the gpu
    preempted: list[tuple[SequenceGroup, PreemptionMode]] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


def is_prefilling(group: SequenceGroup) -> bool:
    """Whether the group's prompt is part-way through being computed in chunks: it then
    holds one running sequence with more than its last token still to compute."""
    seqs = group.get_seqs(SequenceStatus.RUNNING)
    return len(seqs) == 1 and seqs[0].get_len() - seqs[0].num_computed_tokens > 1


def _order(group: SequenceGroup) -> tuple[int, float]:
    """Queue order: priority (lower first), then arrival."""
    return group.sampling_params.priority, group.arrival_time


class Scheduler:
    """Holds the waiting, running and swapped queues, each in order of priority (lower
    first), then arrival.

    The first in that order is served first and preempted last; a step admits new groups
    only when nothing had to be preempted and nothing is waiting in swap.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.last_added = float("-inf")  # clock() when the newest group was queued
        self.pace = TokenPace(config.max_token_slowdown)  # the engine reports each step

    def add_seq_group(self, group: SequenceGroup) -> None:
        """Queue a new request. Raises RequestRejectedError when it could never run."""
        self.check_fits(group.prompt_len, group.sampling_params)
        bisect.insort(self.waiting, group, key=_order)
        self.last_added = self.clock()

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Stop a request wherever it is and free its blocks; returns it, or None."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.status.is_finished:
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return group
        return None

    def recompute_all(self) -> list[SequenceGroup]:
        """The executor lost its pools: free every table and queue every group to be
        recomputed from its tokens. Returns the groups moved."""
        moved = self.running + self.swapped
        for group in moved:
            for seq in group.seqs:
                if not seq.status.is_finished:
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.WAITING
                    seq.num_computed_tokens = 0
            bisect.insort(self.waiting, group, key=_order)
        self.running, self.swapped = [], []
        self.block_manager.forget_cached()
        return moved

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free_finished(self) -> list[SequenceGroup]:
        """Drop finished groups from the running queue; their blocks were freed per sequence."""
        done, running = [], []
        for group in self.running:
            (done if group.is_finished() else running).append(group)
        self.running = running
        return done

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Mutates the queues and the block manager."""
        out = SchedulerOutput()
        self._schedule_running(out)
        if not out.preempted:
            self._schedule_swapped(out)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out)
        self._look_ahead(out)
        assert self._num_running_seqs() <= self.config.max_num_seqs, "seq budget exceeded"
        return out

    def schedule_ahead(
        self, in_flight: dict[int, int], following: Container[int] | None = None
    ) -> SchedulerOutput | None:
        """Decide the call after the one in flight before its tokens come back: every
        running sequence goes on from the token that call draws for it (the executor feeds
        it in), waiting groups are admitted behind them. ``in_flight`` maps each sequence
        the calls in flight draw one sample for to the tokens they draw (their decode
        steps in a row); the sequences of the newest, which the next call follows, are
        ``following`` (None: all of them); any other must end by length within the calls
        in flight.

        None, changing nothing, when no sequence goes on (waiting groups are then admitted
        by ``schedule``) or the next call depends on that call's outcome: a group it does
        not draw for (a prompt chunk) or that may fork or needs its history (beams,
        several samples, penalties, a grammar), anything swapped, or too few free blocks
        for every sequence to go on (which would preempt).

        The slots of the call in flight stay mapped; each sequence maps its next call's
        on top, as if the call in flight drew all its tokens (it may end early or stop).
        """
        if self.swapped:
            return None
        # A group waiting to be admitted behind them would get its first token only once
        # the call's steps in a row had all run.
        k = 1 if self.waiting else self._decode_steps()
        going = []
        for group in self.running:
            params = group.sampling_params
            if params.width != 1 or params.use_beam_search or params.needs_output_tokens:
                return None
            (seq,) = group.get_seqs(SequenceStatus.RUNNING)
            drawing = in_flight.get(seq.seq_id)
            if drawing is None or group.needs_prompt_logprobs:
                return None
            num_steps = min(k, params.max_tokens - len(seq.output_token_ids) - drawing)
            if num_steps > 0:  # else it ends by length with the calls in flight
                if following is not None and seq.seq_id not in following:
                    return None
                going.append((group, seq, seq.get_len() + drawing + num_steps - 1))
        if not going or not self.block_manager.map_ahead([(seq, end) for _, seq, end in going]):
            return None
        out = SchedulerOutput()
        out.scheduled = [ScheduledGroup(group, is_prefill=False) for group, _, _ in going]
        out.num_batched_tokens = len(going)
        self._schedule_waiting(out)
        return out

    # -- the three queues ------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """Give every running sequence a slot, preempting from the back when blocks run out;
        then give prompts computed in chunks what the decodes left of the token budget."""
        prefilling = []
        index = 0
        while index < len(self.running):
            group = self.running[index]
            while not self.block_manager.can_append_slots(group):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                if is_prefilling(group):
                    prefilling.append(group)
                else:
                    self._append_slots(group, out)
                    out.scheduled.append(ScheduledGroup(group, is_prefill=False))
                index += 1
        for group in prefilling:
            self._schedule_chunk(group, out)

    def _schedule_chunk(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The next chunk of a prompt computed in chunks, as far as budget and blocks go."""
        (seq,) = group.get_seqs(SequenceStatus.RUNNING)
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        room = self.block_manager.chunk_room(seq)
        num_tokens = min(seq.get_len() - seq.num_computed_tokens, budget, room)
        if num_tokens > 0:
            self.block_manager.map_chunk(seq, num_tokens)
            out.num_batched_tokens += num_tokens
            out.scheduled.append(ScheduledGroup(group, is_prefill=True))

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped:
            group = self.swapped[0]
            if self.block_manager.can_swap_in(group) != AllocStatus.OK:
                break
            if self._num_running_seqs() + group.max_num_running_seqs() > self.config.max_num_seqs:
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            self._append_slots(group, out)
            bisect.insort(self.running, group, key=_order)
            out.scheduled.append(ScheduledGroup(group, is_prefill=False))

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        """Admit waiting groups while blocks, sequences and the token budget allow.

        With chunked prefill a lone sequence's prompt may start with what is left of the
        budget; a group of several (recomputed after preemption) runs whole, past the
        budget if it is the step's only prompt, so that it cannot wait forever. While
        groups run, their pace may hold newcomers back (TokenPace.admits).
        """
        room = self.pace.admits(len(self.waiting)) if self.running else None
        chunked = self.config.enable_chunked_prefill
        while self.waiting and room != 0:
            group = self.waiting[0]
            in_chunks = chunked and group.num_seqs(SequenceStatus.WAITING) == 1
            status = self.block_manager.can_allocate(group, self._step_tokens(in_chunks))
            if status == AllocStatus.NEVER:
                self.waiting.pop(0)
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_IGNORED
                out.ignored.append(group)
                continue
            budget = self.config.max_num_batched_tokens - out.num_batched_tokens
            num_tokens = sum(s.get_len() for s in group.get_seqs(SequenceStatus.WAITING))
            if in_chunks:
                fits = budget > 0
            else:
                alone = chunked and not any(s.is_prefill for s in out.scheduled)
                fits = num_tokens <= budget or alone
            if (
                status == AllocStatus.LATER
                or not fits
                or self._num_running_seqs() + group.max_num_running_seqs()
                > self.config.max_num_seqs
            ):
                break
            self.waiting.pop(0)
            num_cached = self.block_manager.allocate(group, budget if in_chunks else None)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
                num_slots = self.block_manager.num_slots(seq)
                out.num_batched_tokens += num_slots - seq.num_computed_tokens
            bisect.insort(self.running, group, key=_order)
            out.scheduled.append(ScheduledGroup(group, True, num_cached))
            if room is not None:
                room -= 1

    def _look_ahead(self, out: SchedulerOutput) -> None:
        """Map slots for ``num_decode_steps`` decode steps in a row when the step holds
        only decodes outside beam search (which decides between steps) and no group waits
        for room: the executor then decodes them without coming back.

        Each sequence runs at most to its ``max_tokens``; all of them or none look ahead,
        and only if the pool keeps its watermark free, and only once no group has been
        queued for ``decode_steps_quiet_s``: while requests keep arriving, each of them
        ends the call running (EndSteps), and one step a call loses nothing.
        """
        k = self._decode_steps()
        if k == 1 or self.waiting or self.swapped or out.preempted or not out.scheduled:
            return
        if any(is_prefilling(group) for group in self.running):
            return
        seqs = []
        for scheduled in out.scheduled:
            params = scheduled.group.sampling_params
            if scheduled.is_prefill or params.use_beam_search:
                return
            for seq in scheduled.group.get_seqs(SequenceStatus.RUNNING):
                seqs.append((seq, min(k, params.max_tokens - len(seq.output_token_ids)) - 1))
        bm = self.block_manager
        needed = sum(bm.blocks_to_append(seq, lookahead) for seq, lookahead in seqs)
        if bm.gpu.num_free_blocks - needed < bm.watermark_blocks:
            return
        for seq, lookahead in seqs:
            if lookahead > 0:
                copy = bm.append_slots(seq, lookahead)
                assert copy is None, "the step's own slot already made the tail private"

    # -- helpers ---------------------------------------------------------------------

    def _decode_steps(self) -> int:
        """``num_decode_steps``, or 1 unless quiet (a newcomer would wait for all of them);
        no more than last ``decode_steps_span_s`` at the recent pace, since their tokens
        reach the streams together when the call ends."""
        if not self.is_quiet():
            return 1
        k, span, pace = self.config.num_decode_steps, self.config.decode_steps_span_s, self.pace
        if span and pace.recent > 0:
            k = max(1, min(k, int(span / pace.recent)))
        return k

    def is_quiet(self) -> bool:
        """Whether no group was queued for ``decode_steps_quiet_s``: one arriving now is
        unlikely, so a call may keep the executor busy longer before the next decision."""
        return self.clock() - self.last_added >= self.config.decode_steps_quiet_s

    def _append_slots(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            copy = self.block_manager.append_slots(seq)
            if copy is not None:
                out.blocks_to_copy.append(copy)
            out.num_batched_tokens += seq.get_len() - seq.num_computed_tokens

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Evict the whole group: to CPU blocks, or freed to recompute from the front of
        the waiting queue. Swap falls back to recompute when the CPU pool is full, and a
        prompt part-way through its chunks is recomputed (its table maps only a part)."""
        mode = self.config.preemption_mode
        if mode is None:
            single = group.num_seqs(SequenceStatus.RUNNING) == 1
            mode = PreemptionMode.RECOMPUTE if single else PreemptionMode.SWAP
        if mode == PreemptionMode.SWAP and (
            is_prefilling(group) or not self.block_manager.can_swap_out(group)
        ):
            mode = PreemptionMode.RECOMPUTE
        if mode == PreemptionMode.SWAP:
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            bisect.insort(self.swapped, group, key=_order)
        else:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.status = SequenceStatus.WAITING
                seq.num_computed_tokens = 0
            bisect.insort(self.waiting, group, key=_order)
        group.num_preemptions += 1
        out.preempted.append((group, mode))

    def _step_tokens(self, in_chunks: bool) -> int | None:
        """The most positions of one sequence a step computes when its prompt goes in
        chunks (a chunk, or decode steps in a row); None when it may go whole."""
        if not in_chunks:
            return None
        return max(self.config.max_num_batched_tokens, self.config.num_decode_steps)

    def _num_running_seqs(self) -> int:
        return sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejectedError for a request that could never run. No side effects."""
        if prompt_len == 0:
            raise RequestRejectedError("prompt must hold at least one token")
        total = prompt_len + params.max_tokens
        if total > self.config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the maximum model length {self.config.max_model_len}"
            )
        bm = self.block_manager
        if params.width == 1:  # with a sliding window: what its window and a step hold
            step_tokens = self._step_tokens(self.config.enable_chunked_prefill)
            worst = (
                bm.blocks_for(total)
                if step_tokens is None
                else bm.max_blocks_held(total, step_tokens)
            )
        else:  # shared prompt blocks, then a private tail per sequence (its CoW copy included)
            tail = bm.blocks_for(params.max_tokens) + 1
            worst = bm.blocks_for(prompt_len) + params.width * tail
        capacity = bm.gpu.num_blocks - bm.watermark_blocks
        if worst > capacity:
            raise RequestRejectedError(
                f"request needs up to {worst} KV blocks but the pool holds {capacity}"
            )
