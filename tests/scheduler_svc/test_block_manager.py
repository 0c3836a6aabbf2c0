"""The paper's block-manager walkthroughs (Figures 6-9) with exact block ids."""

from __future__ import annotations

import random

import pytest

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.core.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block
from scheduler_svc.core.block_manager import AllocStatus, BlockManager
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus


def make_group(request_id: str, prompt: list[int], seq_id: int = 0, **params) -> SequenceGroup:
    seq = Sequence(seq_id, list(prompt))
    return SequenceGroup(
        request_id, [seq], arrival_time=0.0, sampling_params=SamplingParams(**params)
    )


def admit(bm: BlockManager, group: SequenceGroup) -> int:
    num_cached = bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    bm.check_integrity()
    return num_cached


def decode(bm: BlockManager, seq: Sequence, token_id: int):
    seq.append_token(token_id)
    copy = bm.append_slots(seq)
    bm.check_integrity()
    return copy


def test_figure6_prompt_then_decode_allocates_on_demand():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    group = make_group("a", [11, 12, 13, 14, 15, 16, 17])  # "Four score and seven years ago our"
    assert bm.can_allocate(group) == AllocStatus.OK
    admit(bm, group)
    seq = group.seqs[0]
    assert bm.get_block_table(seq) == [0, 1]  # block 1 holds 3 tokens, 1 slot free
    assert decode(bm, seq, 18) is None  # fills the free slot of block 1
    assert bm.get_block_table(seq) == [0, 1]
    assert decode(bm, seq, 19) is None  # block 1 is full: a new block on demand
    assert bm.get_block_table(seq) == [0, 1, 2]
    assert bm.gpu.num_used_blocks == 3
    assert bm.slot_utilization() == pytest.approx(9 / 12)


def test_figure7_two_sequences_interleave_in_one_pool():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    a = make_group("a", [1, 2, 3, 4, 5, 6, 7], seq_id=0)
    b = make_group("b", [9, 8, 7, 6, 5], seq_id=1)
    admit(bm, a)
    admit(bm, b)
    decode(bm, a.seqs[0], 8)
    decode(bm, a.seqs[0], 9)  # a needs its third block after b took 2 and 3
    decode(bm, b.seqs[0], 4)
    assert bm.get_block_table(a.seqs[0]) == [0, 1, 4]
    assert bm.get_block_table(b.seqs[0]) == [2, 3]
    bm.free(a.seqs[0])
    assert bm.gpu.num_free_blocks == 6
    bm.check_integrity()


def test_figure8_parallel_sampling_copy_on_write():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    group = make_group("a", [1, 2, 3, 4, 5, 6, 7], n=2)
    admit(bm, group)
    sample_a = group.seqs[0]
    sample_b = sample_a.fork(1)
    bm.fork(sample_a, sample_b)
    group.seqs.append(sample_b)
    assert bm.get_block_table(sample_b) == [0, 1]
    assert bm.gpu.ref_counts[:2] == [2, 2]
    # Sample A writes first into the shared last block: it moves to a copy.
    assert decode(bm, sample_a, 100) == (1, 2)
    assert bm.get_block_table(sample_a) == [0, 2]
    assert bm.gpu.ref_counts[:3] == [2, 1, 1]
    assert bm.counters.cow_copies == 1
    # Sample B is now the only holder of block 1 and writes in place.
    assert decode(bm, sample_b, 200) is None
    assert bm.get_block_table(sample_b) == [0, 1]
    for seq in group.seqs:
        bm.free(seq)
    assert bm.gpu.num_free_blocks == 8
    bm.check_integrity()


def test_figure9_beam_fork_and_free_return_blocks_at_once():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0)
    group = make_group("a", [1, 2, 3, 4, 5, 6, 7, 8], use_beam_search=True, n=2, temperature=0)
    admit(bm, group)
    beam0 = group.seqs[0]
    beam1 = beam0.fork(1)
    bm.fork(beam0, beam1)
    decode(bm, beam0, 10)
    decode(bm, beam1, 11)
    assert bm.get_block_table(beam0) == [0, 1, 2]
    assert bm.get_block_table(beam1) == [0, 1, 3]
    # Both survivors descend from beam0: beam1 is eliminated, beam0 forks.
    bm.free(beam1)
    assert bm.gpu.num_free_blocks == 5  # block 3 is back at once
    beam2 = beam0.fork(2)
    bm.fork(beam0, beam2)
    assert decode(bm, beam0, 12) == (2, 3)  # the shared tail block is copied on write
    assert decode(bm, beam2, 13) is None
    assert bm.get_block_table(beam0) == [0, 1, 3]
    assert bm.get_block_table(beam2) == [0, 1, 2]
    assert bm.gpu.ref_counts[:4] == [2, 2, 1, 1]


def test_prefix_cache_maps_full_blocks_and_reports_computed_tokens():
    bm = BlockManager(4, 8, 0, watermark=0, enable_prefix_caching=True)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    first = make_group("a", [*system, 9, 10], seq_id=0)
    assert admit(bm, first) == 0
    second = make_group("b", [*system, 11], seq_id=1)
    assert admit(bm, second) == 8
    assert second.seqs[0].num_computed_tokens == 8
    assert bm.get_block_table(second.seqs[0]) == [0, 1, 3]
    assert bm.gpu.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.counters.prefix_cache_queries, bm.counters.prefix_cache_hits) == (19, 8)


def test_prefix_cache_never_reuses_the_block_of_the_last_token():
    bm = BlockManager(4, 8, 0, watermark=0, enable_prefix_caching=True)
    admit(bm, make_group("a", [1, 2, 3, 4, 5, 6, 7, 8], seq_id=0))
    again = make_group("b", [1, 2, 3, 4, 5, 6, 7, 8], seq_id=1)
    assert admit(bm, again) == 4  # the last token's block is computed afresh
    assert bm.get_block_table(again.seqs[0]) == [0, 2]


def test_a_prompt_in_chunks_publishes_only_the_blocks_its_chunks_compute():
    """A later prompt with the same tokens reuses the first chunk's blocks, never blocks
    mapped for chunks no step has computed yet; each chunk then publishes its own."""
    bm = BlockManager(4, 16, 0, watermark=0, enable_prefix_caching=True)
    prompt = list(range(100, 120))  # five blocks of 4
    first = make_group("a", prompt, seq_id=0)
    assert bm.allocate(first, max_new_tokens=8) == 0
    first.seqs[0].status = SequenceStatus.RUNNING
    assert bm.num_slots(first.seqs[0]) == 8 and len(bm.get_block_table(first.seqs[0])) == 2
    bm.check_integrity()
    early = make_group("b", prompt, seq_id=1)
    assert bm.allocate(early, max_new_tokens=4) == 8  # the first chunk's two blocks only
    first.seqs[0].num_computed_tokens = 8
    bm.map_chunk(first.seqs[0], 8)
    late = make_group("c", prompt, seq_id=2)
    assert admit(bm, late) == 16  # two chunks computed: four blocks
    with pytest.raises(ValueError, match="chunk past"):
        bm.map_chunk(first.seqs[0], 5)


def test_freed_cached_blocks_are_reused_then_evicted_least_recent_first():
    bm = BlockManager(4, 4, 0, watermark=0, enable_prefix_caching=True)
    a = make_group("a", [1, 2, 3, 4, 5], seq_id=0)
    admit(bm, a)
    bm.free(a.seqs[0])
    assert bm.gpu.num_free_blocks == 4 and bm.gpu.is_cached(0)
    b = make_group("b", [1, 2, 3, 4, 6], seq_id=1)
    assert admit(bm, b) == 4  # block 0 revived from the cache
    assert bm.get_block_table(b.seqs[0]) == [0, 1]
    bm.free(b.seqs[0])
    # A prompt that needs the whole pool evicts the idle cached block.
    c = make_group("c", list(range(100, 116)), seq_id=2)
    assert admit(bm, c) == 0
    assert sorted(bm.get_block_table(c.seqs[0])) == [0, 1, 2, 3]
    assert bm.gpu.lookup(hash_block(None, [1, 2, 3, 4]), [1, 2, 3, 4]) is None


def test_swap_out_and_in_is_all_or_nothing_and_keeps_sharing():
    bm = BlockManager(4, 8, 8, watermark=0)
    group = make_group("a", [1, 2, 3, 4, 5, 6], n=2)
    admit(bm, group)
    parent = group.seqs[0]
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    decode(bm, parent, 7)  # copy-on-write of block 1 to 2
    decode(bm, child, 8)
    assert bm.can_swap_out(group)
    mapping = bm.swap_out(group)
    assert mapping == [(0, 0), (2, 1), (1, 2)]  # block 0 is shared and moves once
    assert bm.get_block_table(parent) == [0, 1] and bm.get_block_table(child) == [0, 2]
    assert bm.cpu.ref_counts[:3] == [2, 1, 1]
    assert bm.gpu.num_free_blocks == 8
    assert {s.status for s in group.seqs} == {SequenceStatus.SWAPPED}
    bm.check_integrity()
    assert bm.can_swap_in(group) == AllocStatus.OK
    back = bm.swap_in(group)
    assert back == [(0, 0), (1, 1), (2, 2)]
    assert bm.gpu.ref_counts[:3] == [2, 1, 1] and bm.cpu.num_free_blocks == 8
    assert bm.counters.swapped_out_blocks == bm.counters.swapped_in_blocks == 3
    bm.check_integrity()


def test_watermark_makes_admission_wait_and_oversized_prompts_never_fit():
    bm = BlockManager(4, 10, 0, watermark=0.2)  # 2 blocks held back
    big = make_group("a", list(range(1, 30)), seq_id=0)  # 8 blocks: leaves exactly 2
    assert bm.can_allocate(big) == AllocStatus.OK
    admit(bm, big)
    assert bm.can_allocate(make_group("b", [1], seq_id=1)) == AllocStatus.LATER
    assert bm.can_allocate(make_group("c", list(range(40)), seq_id=2)) == AllocStatus.NEVER


def test_allocator_refuses_double_free_and_exhaustion():
    pool = BlockAllocator("gpu", 2)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.free(0)
    with pytest.raises(ValueError, match="double free"):
        pool.free(0)
    pool.check_integrity()


@pytest.mark.parametrize("window", [0, 6])
def test_mapping_ahead_in_one_pass_equals_appending_slots_sequence_by_sequence(window):
    """Calls sent ahead map every running sequence's slots at once (``map_ahead``): the
    tables, slot counts, published prefix blocks and free blocks are those that
    ``append_slots`` gives one sequence at a time, over block boundaries and the
    steps of calls in a row, under a sliding window too; past the watermark it refuses
    and changes nothing."""
    rng = random.Random(window)

    def build() -> tuple[BlockManager, list[Sequence]]:
        bm = BlockManager(
            4, 64, 0, watermark=0.1, enable_prefix_caching=True, sliding_window=window
        )
        seqs = []
        for i in range(6):
            group = make_group(str(i), [1, 2, 3, 4, 5, 6][: 1 + i] + [9] * (i % 3), seq_id=i)
            admit(bm, group)
            seqs.append(group.seqs[0])
        return bm, seqs

    (one, one_seqs), (bulk, bulk_seqs) = build(), build()
    for _ in range(30):
        lookaheads = [rng.choice([0, 0, 1, 3, 7]) for _ in one_seqs]
        token = rng.randrange(1, 4)
        for seq in one_seqs + bulk_seqs:
            seq.num_computed_tokens = seq.get_len()
            seq.append_token(token)
        for seq, lookahead in zip(one_seqs, lookaheads, strict=True):
            assert one.append_slots(seq, lookahead) is None
        targets = [(s, s.get_len() + k) for s, k in zip(bulk_seqs, lookaheads, strict=True)]
        assert bulk.map_ahead(targets)
        for bm in (one, bulk):
            bm.check_integrity()
        assert bulk.block_tables == one.block_tables
        assert bulk._num_slots == one._num_slots and bulk._hashes == one._hashes
        assert bulk.gpu.num_free_blocks == one.gpu.num_free_blocks
        assert bulk.gpu.cached_block_ids() == one.gpu.cached_block_ids()
    before = ({k: list(v) for k, v in bulk.block_tables.items()}, dict(bulk._num_slots))
    far = [(s, s.get_len() + 4 * 64) for s in bulk_seqs]
    assert not bulk.map_ahead(far)
    assert (bulk.block_tables, bulk._num_slots) == before
