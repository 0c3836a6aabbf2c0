"""Where BlockAllocator puts a growing table: in runs of physically contiguous blocks."""

from __future__ import annotations

import random

import pytest

from scheduler_svc.core.block_allocator import BlockAllocator, NoFreeBlocksError

RUN = BlockAllocator.RUN


def grow(pool: BlockAllocator, table: list[int], n: int) -> list[int]:
    for _ in range(n):
        table.append(pool.allocate(after=table[-1] if table else None))
    return table


def test_tables_growing_in_turn_each_stay_contiguous():
    pool = BlockAllocator("gpu", 4 * RUN)
    a, b = [], []
    for _ in range(RUN):  # interleaved growth, as sequences decoding side by side
        grow(pool, a, 1)
        grow(pool, b, 1)
    assert a == list(range(RUN))
    assert b == list(range(RUN, 2 * RUN))
    grow(pool, a, 1)  # a's next block belongs to b: a starts a fresh run
    assert a[-1] == 2 * RUN
    pool.check_integrity()


def test_a_run_freed_whole_is_handed_out_again_before_scattered_blocks():
    pool = BlockAllocator("gpu", 3 * RUN)
    a, b, c = grow(pool, [], RUN), grow(pool, [], RUN), grow(pool, [], RUN)
    for block_id in b:
        pool.free(block_id)
    pool.free(a[3])  # a lone hole, lower than b's run
    assert grow(pool, [], 2) == [RUN, RUN + 1]
    assert pool.allocate() == 3  # no wholly free run left: the lowest free block
    pool.free(c[0])
    assert pool.allocate(after=c[-1]) == RUN + 2  # c ends the pool: the lowest free again
    pool.check_integrity()


def test_a_full_pool_takes_any_free_block_then_refuses():
    pool = BlockAllocator("gpu", RUN + 3)  # a short last run
    table = grow(pool, [], RUN + 3)
    assert table == list(range(RUN + 3))
    pool.free(5)
    assert pool.allocate(after=table[-1]) == 5
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(after=2)


def test_random_churn_keeps_every_block_in_one_state():
    """Blocks taken after a table's last one leave stale heap entries behind; a long churn of
    growth and frees must still hand out each free block exactly once."""
    rng = random.Random(0)
    pool = BlockAllocator("gpu", 5 * RUN + 2)
    tables: list[list[int]] = []
    for step in range(3000):
        if pool.num_free_blocks and (not tables or rng.random() < 0.6):
            if tables and rng.random() < 0.8:
                grow(pool, rng.choice(tables), 1)
            else:
                tables.append(grow(pool, [], 1))
        else:
            for block_id in tables.pop(rng.randrange(len(tables))):
                pool.free(block_id)
        held = [b for t in tables for b in t]
        assert len(held) == len(set(held)) == pool.num_used_blocks, step
        if step % 100 == 0:
            pool.check_integrity()
    assert len(pool._lowest) <= 2 * pool.num_free_blocks + RUN  # stale entries stay bounded
