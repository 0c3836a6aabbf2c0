"""Random interleavings of allocate / fork / append / free / swap / prefix hits.

After every operation the reference counts must equal the number of tables holding each
block, and every sequence must read its own tokens back through its table from a
simulated KV store, so no block is leaked, double-owned or overwritten by a sharer.
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import NO_BLOCK
from scheduler_svc.core.block_manager import AllocStatus, BlockManager
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus

BLOCK_SIZE = 4


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOW = 0  # a sliding window: blocks wholly before it go back to the pool

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            BLOCK_SIZE,
            12,
            10,
            watermark=0.0,
            enable_prefix_caching=True,
            sliding_window=self.WINDOW,
        )
        self.gpu = [[None] * BLOCK_SIZE for _ in range(12)]
        self.cpu = [[None] * BLOCK_SIZE for _ in range(10)]
        self.groups: list[SequenceGroup] = []
        self.ids = itertools.count()

    def _running(self) -> list[tuple[SequenceGroup, Sequence]]:
        return [(g, s) for g in self.groups for s in g.get_seqs(SequenceStatus.RUNNING)]

    def _write(self, seq: Sequence, start: int) -> None:
        table, tokens = self.bm.get_block_table(seq), seq.get_token_ids()
        for pos in range(start, seq.get_len()):
            self.gpu[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = tokens[pos]

    # A small alphabet and a common stem make prefix-cache hits frequent.
    @rule(tail=st.lists(st.integers(1, 3), min_size=0, max_size=9), stem=st.booleans())
    def allocate(self, tail: list[int], stem: bool) -> None:
        prompt = ([7, 7, 7, 7] if stem else []) + tail or [5]
        group = SequenceGroup(
            str(next(self.ids)), [Sequence(next(self.ids), prompt)], 0.0, SamplingParams()
        )
        if self.bm.can_allocate(group) != AllocStatus.OK:
            return
        self.bm.allocate(group)
        seq = group.seqs[0]
        seq.status = SequenceStatus.RUNNING
        self._write(seq, seq.num_computed_tokens)
        self.groups.append(group)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        group, parent = data.draw(st.sampled_from(self._running()))
        child = parent.fork(next(self.ids))
        self.bm.fork(parent, child)
        group.seqs.append(child)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), token=st.integers(1, 3))
    def append(self, data: st.DataObject, token: int) -> None:
        _, seq = data.draw(st.sampled_from(self._running()))
        if self.bm.gpu.num_free_blocks < 1:
            return
        seq.num_computed_tokens = seq.get_len()  # as after the step that drew ``token``
        seq.append_token(token)
        copy = self.bm.append_slots(seq)
        if copy is not None:
            self.gpu[copy[1]] = list(self.gpu[copy[0]])
        self._write(seq, seq.get_len() - 1)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        group, seq = data.draw(st.sampled_from(self._running()))
        self.bm.free(seq)
        group.seqs.remove(seq)
        if not group.seqs:
            self.groups.remove(group)

    @precondition(lambda self: any(g.get_seqs(SequenceStatus.RUNNING) for g in self.groups))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(
            st.sampled_from([g for g in self.groups if g.get_seqs(SequenceStatus.RUNNING)])
        )
        if not self.bm.can_swap_out(group):
            return
        for gpu_block, cpu_block in self.bm.swap_out(group):
            self.cpu[cpu_block] = list(self.gpu[gpu_block])

    @precondition(lambda self: any(g.get_seqs(SequenceStatus.SWAPPED) for g in self.groups))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(
            st.sampled_from([g for g in self.groups if g.get_seqs(SequenceStatus.SWAPPED)])
        )
        if self.bm.can_swap_in(group) != AllocStatus.OK:
            return
        for cpu_block, gpu_block in self.bm.swap_in(group):
            self.gpu[gpu_block] = list(self.cpu[cpu_block])

    @invariant()
    def tables_match_refcounts_and_contents(self) -> None:
        self.bm.check_integrity()
        for group in self.groups:
            for seq in group.seqs:
                pool = self.cpu if seq.status == SequenceStatus.SWAPPED else self.gpu
                table = self.bm.get_block_table(seq)
                first = max(0, seq.num_computed_tokens - self.WINDOW + 1) if self.WINDOW else 0
                positions = range(first, seq.get_len())  # what the next step reads
                seen = [pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in positions]
                assert seen == seq.get_token_ids()[first:], f"seq {seq.seq_id} lost its tokens"

    @invariant()
    def slot_utilization_counts_each_block_once(self) -> None:
        """Against a walk over every slot of every table on the GPU."""
        filled: dict[int, int] = {}
        for group in self.groups:
            for seq in group.seqs:
                if seq.status == SequenceStatus.SWAPPED or seq.seq_id not in self.bm.block_tables:
                    continue
                for index, block_id in enumerate(self.bm.get_block_table(seq)):
                    if block_id != NO_BLOCK:
                        used = min(BLOCK_SIZE, self.bm.num_slots(seq) - index * BLOCK_SIZE)
                        filled[block_id] = max(filled.get(block_id, 0), used)
        expected = sum(filled.values()) / (len(filled) * BLOCK_SIZE) if filled else 1.0
        assert self.bm.slot_utilization() == expected

    def teardown(self) -> None:
        for group in self.groups:
            for seq in group.seqs:
                self.bm.free(seq)
        self.bm.check_integrity()
        assert self.bm.gpu.num_free_blocks == 12 and self.bm.cpu.num_free_blocks == 10


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
TestBlockManagerProperties = BlockManagerMachine.TestCase


class WindowedBlockManagerMachine(BlockManagerMachine):
    WINDOW = 6


WindowedBlockManagerMachine.TestCase.settings = BlockManagerMachine.TestCase.settings
TestWindowedBlockManagerProperties = WindowedBlockManagerMachine.TestCase
