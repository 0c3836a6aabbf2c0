"""Block copies and swap round trips keep every byte of every block."""

from __future__ import annotations

import torch

from executor_svc.cache_engine import CacheEngine, CacheShape


def make_engine() -> CacheEngine:
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    engine = CacheEngine(shape, num_gpu_blocks=10, num_cpu_blocks=6, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for key, value in engine.gpu_cache:
        key.copy_(torch.randn(key.shape, generator=generator))
        value.copy_(torch.randn(value.shape, generator=generator))
    return engine


def snapshot(cache: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in cache]


def test_bytes_per_block_counts_keys_values_and_layers():
    shape = CacheShape(
        num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32
    )
    assert shape.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert shape.num_blocks_for(1 << 30) == (1 << 30) // shape.bytes_per_block


def test_copy_blocks_applies_every_pair_in_every_layer():
    engine = make_engine()
    before = snapshot(engine.gpu_cache)
    engine.copy([(1, 7), (2, 8), (1, 9)])
    for (key, value), (old_key, old_value) in zip(engine.gpu_cache, before, strict=True):
        for src, dst in [(1, 7), (2, 8), (1, 9)]:
            assert torch.equal(key[dst], old_key[src]) and torch.equal(value[dst], old_value[src])
        untouched = [0, 1, 2, 3, 4, 5, 6]
        assert torch.equal(key[untouched], old_key[untouched])


def test_swap_out_then_in_round_trips_exactly():
    engine = make_engine()
    before = snapshot(engine.gpu_cache)
    engine.swap_out([(3, 0), (5, 4), (9, 1)])
    for key, _ in engine.gpu_cache:  # the blocks' old place gets overwritten meanwhile
        key[[3, 5, 9]] = 0.0
    engine.swap_in([(0, 2), (4, 6), (1, 7)])
    for (key, value), (old_key, old_value) in zip(engine.gpu_cache, before, strict=True):
        for old, new in [(3, 2), (5, 6), (9, 7)]:
            assert torch.equal(key[new], old_key[old])
            assert torch.equal(value[new], old_value[old])
