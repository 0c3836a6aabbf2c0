"""Blocks that fall wholly before a sliding window go back to the pool, with exact block ids:
8 blocks of 4 tokens, a window of 6 positions (a token sees itself and the 5 before)."""

from __future__ import annotations

import math
import random

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import PreemptionMode, SchedulerConfig
from pagedserve.step import NO_BLOCK
from scheduler_svc.core.block_manager import AllocStatus, BlockManager
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import Sequence, SequenceGroup
from tests.scheduler_svc.fake_executor import FakeExecutor, run_engine
from tests.scheduler_svc.test_block_manager import admit, make_group

WINDOW = 6
PROMPT = [11, 12, 13, 14, 15, 16, 17]


def window_manager(**kwargs) -> BlockManager:
    args = {"num_gpu_blocks": 8, "num_cpu_blocks": 4, "watermark": 0, "sliding_window": WINDOW}
    return BlockManager(block_size=4, **(args | kwargs))


def run_step(bm: BlockManager, seq: Sequence, token_id: int):
    """One decode step as the engine runs it: every token so far computed, a new one drawn,
    its slot mapped."""
    seq.num_computed_tokens = seq.get_len()
    seq.append_token(token_id)
    copy = bm.append_slots(seq)
    bm.check_integrity()
    return copy


def test_a_block_goes_back_once_the_window_has_passed_it():
    bm = window_manager()
    group = make_group("a", PROMPT)
    admit(bm, group)
    seq = group.seqs[0]
    run_step(bm, seq, 18)  # next position 7 sees 2..7: block 0 still read
    run_step(bm, seq, 19)
    assert bm.get_block_table(seq) == [0, 1, 2]
    run_step(bm, seq, 20)  # position 9 sees 4..9: block 0 (0..3) is out
    assert bm.get_block_table(seq) == [NO_BLOCK, 1, 2]
    assert bm.gpu.num_used_blocks == 2 and bm.counters.window_freed_blocks == 1
    for token_id in range(21, 25):
        run_step(bm, seq, token_id)  # position 13 sees 8..13: block 1 out, block 3 in
    assert bm.get_block_table(seq) == [NO_BLOCK, NO_BLOCK, 2, 3]
    bm.free(seq)
    assert bm.gpu.num_free_blocks == 8
    bm.check_integrity()


def test_blocks_in_use_stay_bounded_through_a_long_generation():
    """ceil(window / block_size) + 1 blocks cover any window: the bound at every step."""
    bm = window_manager()
    group = make_group("a", PROMPT)
    admit(bm, group)
    seq = group.seqs[0]
    bound = math.ceil(WINDOW / bm.block_size) + 1
    for token_id in range(200):
        run_step(bm, seq, token_id)
        assert bm.gpu.num_used_blocks <= bound
    assert len(bm.get_block_table(seq)) == bm.blocks_for(seq.get_len())  # positions kept
    assert bm.counters.window_freed_blocks == len(bm.get_block_table(seq)) - bound + 1


def test_without_a_window_nothing_is_freed():
    """A model with a global layer (Gemma 3) reads every position there: window 0."""
    bm = window_manager(sliding_window=0)
    group = make_group("a", PROMPT)
    admit(bm, group)
    for token_id in range(9):
        run_step(bm, group.seqs[0], token_id)
    assert bm.get_block_table(group.seqs[0]) == [0, 1, 2, 3]


def test_a_prompt_in_chunks_frees_only_what_no_later_chunk_reads():
    bm = window_manager()
    group = make_group("a", list(range(1, 21)))
    bm.allocate(group, max_new_tokens=8)
    seq = group.seqs[0]
    seq.num_computed_tokens = 8
    bm.map_chunk(seq, 8)  # queries 8..15: position 8 sees 3..8, block 0 still read
    assert bm.get_block_table(seq) == [0, 1, 2, 3]
    seq.num_computed_tokens = 16
    bm.map_chunk(seq, 4)  # queries 16..19: position 16 sees 11..16, blocks 0 and 1 out
    assert bm.get_block_table(seq) == [NO_BLOCK, NO_BLOCK, 2, 3, 4]
    bm.check_integrity()


def test_a_freed_prefix_block_stays_cached_and_serves_the_next_prompt():
    bm = window_manager(enable_prefix_caching=True)
    prompt = list(range(1, 14))  # 13 tokens: blocks 0..2 full and hashed
    a = make_group("a", prompt)
    admit(bm, a)
    run_step(bm, a.seqs[0], 99)  # position 13 sees 8..13: blocks 0, 1 out
    assert bm.get_block_table(a.seqs[0]) == [NO_BLOCK, NO_BLOCK, 2, 3]
    assert bm.gpu.ref_counts[:2] == [0, 0] and bm.gpu.is_cached(0) and bm.gpu.is_cached(1)
    b = make_group("b", prompt, seq_id=1)
    assert admit(bm, b) == 12  # blocks 0..2 found; then block 0 is outside b's window too
    assert bm.get_block_table(b.seqs[0]) == [NO_BLOCK, 1, 2, 4]
    assert bm.gpu.ref_counts[:5] == [0, 1, 2, 1, 1]
    # A prompt of its own takes the free blocks and then evicts block 0: the chain of
    # the first prompt is broken at its first block, so a third copy finds nothing.
    c = make_group("c", list(range(50, 66)), seq_id=2)
    admit(bm, c)
    assert bm.get_block_table(c.seqs[0]) == [5, 6, 7, 0]
    bm.free(a.seqs[0])
    bm.free(b.seqs[0])
    assert admit(bm, make_group("d", prompt, seq_id=3)) == 0


def test_forks_share_the_freed_table_and_copy_on_write_the_tail():
    bm = window_manager()
    group = make_group("a", PROMPT, n=2)
    admit(bm, group)
    parent = group.seqs[0]
    for token_id in (18, 19, 20):
        run_step(bm, parent, token_id)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert bm.get_block_table(child) == [NO_BLOCK, 1, 2]
    assert bm.gpu.ref_counts[:3] == [0, 2, 2]
    # The shared, partly filled tail is copied, into the block the window freed.
    assert run_step(bm, parent, 21) == (2, 0)
    assert bm.get_block_table(parent) == [NO_BLOCK, 1, 0]
    bm.free(parent)
    bm.free(child)
    assert bm.gpu.num_free_blocks == 8
    bm.check_integrity()


def test_a_swapped_table_keeps_its_freed_entries():
    bm = window_manager()
    group = make_group("a", PROMPT)
    admit(bm, group)
    seq = group.seqs[0]
    for token_id in (18, 19, 20):
        run_step(bm, seq, token_id)
    assert bm.swap_out(group) == [(1, 0), (2, 1)]  # only held blocks move
    assert bm.get_block_table(seq) == [NO_BLOCK, 0, 1]
    assert bm.gpu.num_free_blocks == 8
    bm.check_integrity()
    assert bm.swap_in(group) == [(0, 0), (1, 1)]
    assert bm.get_block_table(seq) == [NO_BLOCK, 0, 1]
    bm.check_integrity()


def test_a_persisted_table_with_freed_entries_restores():
    bm = window_manager()
    seq = Sequence(0, PROMPT, [18, 19])
    assert bm.fits_pool([NO_BLOCK, 5, 6], on_cpu=False)
    assert not bm.fits_pool([5, NO_BLOCK, 6], on_cpu=False)  # freed entries lead
    assert not window_manager(sliding_window=0).fits_pool([NO_BLOCK, 5], on_cpu=False)
    bm.restore(seq, [NO_BLOCK, 5, 6], 9, on_cpu=False)
    assert bm.gpu.ref_counts[5:7] == [1, 1] and bm.gpu.num_used_blocks == 2
    bm.check_integrity()


def test_a_prompt_longer_than_the_pool_is_admitted_in_chunks():
    """40 tokens take 10 blocks of the 8, but steps of at most 8 positions under a window of
    6 hold at most blocks_for(5 + 8) + 1 = 5 at once."""
    bm = window_manager()
    group = make_group("a", list(range(1, 41)))
    assert bm.can_allocate(group) == AllocStatus.NEVER
    assert bm.max_blocks_held(40, step_tokens=8) == 5
    assert bm.can_allocate(group, step_tokens=8) == AllocStatus.OK
    assert window_manager(sliding_window=0).can_allocate(group, step_tokens=8) == AllocStatus.NEVER


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
@pytest.mark.parametrize("num_gpu_blocks", [12, 15, 16, 24])
def test_the_scheduler_runs_long_sequences_through_a_small_pool(mode, num_gpu_blocks):
    """Prompts and outputs of many windows, two sharing a prefix, in chunks, on pools that
    hold a few windows: the fake executor reads every window back intact at every step,
    whatever preemption and the prefix cache did to the tables."""
    bm = BlockManager(8, num_gpu_blocks, 64, 0.01, enable_prefix_caching=True, sliding_window=24)
    config = SchedulerConfig(max_num_batched_tokens=32, max_model_len=1024, preemption_mode=mode)
    scheduler = Scheduler(config, bm)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(48)]
    for i, n in enumerate([150, 280, 230, 40]):
        prompt = (prefix if i < 2 else []) + [rng.randrange(3, 500) for _ in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        scheduler.add_seq_group(SequenceGroup(str(i), [Sequence(i, prompt)], i, params))
    finished, outputs = run_engine(scheduler, FakeExecutor(bm))
    assert [len(g.seqs[0].output_token_ids) for g in finished] == [200] * 4
    bm.check_integrity()
    assert bm.gpu.num_used_blocks == 0 and bm.counters.window_freed_blocks > 0
    if num_gpu_blocks == 16:  # decoding groups swapped, prompts part-way recomputed
        modes = [mode for out in outputs for _, mode in out.preempted]
        assert PreemptionMode.RECOMPUTE in modes and mode in modes
