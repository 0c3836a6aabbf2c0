"""CPU paths of kernels.ops against the naive reference (fp32: atol 1e-5, rtol 1e-4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import ops, reference
from tests.kernels.cases import as_bytes, make_paged_kv, random_bytes

NUM_KV_HEADS = 2
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    context_lens = [1, block_size - 1, block_size, block_size + 1, 97, 300]
    kv = make_paged_kv(context_lens, block_size, NUM_KV_HEADS, head_dim)
    query = _query(len(context_lens), NUM_KV_HEADS * group, head_dim, torch.float32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention_decode(*args, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(
        out, reference.paged_attention_decode(*args, scale), **TOL[out.dtype]
    )


def _prefill_inputs(
    seqs: list[tuple[int, int]], block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(context_len, q_len) per sequence -> the prefill arguments, scale excluded."""
    kv = make_paged_kv([c for c, _ in seqs], block_size, NUM_KV_HEADS, head_dim, dtype=dtype)
    q_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = F.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    query = _query(int(q_lens.sum()), NUM_KV_HEADS * group, head_dim, dtype)
    return (query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc, kv.context_lens)


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"),
    [(8, 64, 1), (8, 64, 4), (16, 64, 2), (16, 128, 4), (32, 64, 1), (32, 128, 2)],
)
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int) -> None:
    # whole prompts, a chunk after a cached prefix, single tokens, an exact block
    seqs = [(1, 1), (37, 37), (300, 9), (50, 1), (block_size, block_size), (2 * block_size, 3)]
    args = _prefill_inputs(seqs, block_size, head_dim, group, torch.float32)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention_prefill(*args, scale)
    assert out.shape == args[0].shape
    torch.testing.assert_close(
        out, reference.paged_attention_prefill(*args, scale), **TOL[out.dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_keeps_dtype_and_matches(dtype: torch.dtype) -> None:
    args = _prefill_inputs([(70, 70), (130, 4)], 16, 64, 2, dtype)
    out = ops.paged_attention_prefill(*args, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.paged_attention_prefill(*args, 0.125), **TOL[dtype])
    kv = make_paged_kv([5, 200], 16, NUM_KV_HEADS, 64, dtype=dtype)
    query = _query(2, 4, 64, dtype)
    decode_args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens)
    out = ops.paged_attention_decode(*decode_args, 0.125)
    assert out.dtype == dtype
    expected = reference.paged_attention_decode(*decode_args, 0.125)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_decode_equals_prefill_of_one_token() -> None:
    seqs = [(1, 1), (40, 1), (129, 1)]
    query, key_cache, value_cache, tables, query_start_loc, context_lens = _prefill_inputs(
        seqs, 16, 64, 4, torch.float32
    )
    prefill = ops.paged_attention_prefill(
        query, key_cache, value_cache, tables, query_start_loc, context_lens, 0.125
    )
    decode = ops.paged_attention_decode(query, key_cache, value_cache, tables, context_lens, 0.125)
    torch.testing.assert_close(decode, prefill, atol=1e-6, rtol=1e-5)


def test_reference_and_ops_match_dense_causal_attention() -> None:
    """An identity block table makes the paged cache one contiguous sequence."""
    block_size, num_blocks, head_dim = 8, 5, 64
    n = block_size * num_blocks - 3
    gen = torch.Generator().manual_seed(2)
    key_cache, value_cache = torch.randn(2, num_blocks, block_size, 1, head_dim, generator=gen)
    query = torch.randn(n, 2, head_dim, generator=gen)
    tables = torch.arange(num_blocks, dtype=torch.int32)[None]
    args = (query, key_cache, value_cache, tables, torch.tensor([0, n], dtype=torch.int32))
    dense = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key_cache.flatten(0, 1)[:n].transpose(0, 1).expand(2, n, head_dim),
        value_cache.flatten(0, 1)[:n].transpose(0, 1).expand(2, n, head_dim),
        is_causal=True,
        scale=0.125,
    ).transpose(0, 1)
    context_lens = torch.tensor([n], dtype=torch.int32)
    for fn in (ops.paged_attention_prefill, reference.paged_attention_prefill):
        torch.testing.assert_close(fn(*args, context_lens, 0.125), dense, atol=1e-5, rtol=1e-4)


def test_mismatched_heads_raise() -> None:
    kv = make_paged_kv([4], 8, 2, 64)
    query = _query(1, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="kv heads"):
        ops.paged_attention_decode(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125
        )


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(block_size: int) -> None:
    num_blocks, num_tokens = 6, 2 * block_size + 3
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, num_tokens, NUM_KV_HEADS, 64, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    caches = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, 64, generator=gen)
    key_cache, value_cache = caches.clone()
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)

    expected = caches.clone()
    reference.reshape_and_cache(key, value, expected[0], expected[1], slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for new, cache, before in ((key, key_cache, caches[0]), (value, value_cache, caches[1])):
        rows = cache.view(-1, NUM_KV_HEADS, 64)
        assert torch.equal(rows[slots[slots >= 0]], new[slots >= 0])
        assert torch.equal(rows[~written], before.view(-1, NUM_KV_HEADS, 64)[~written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_blocks_preserves_every_byte(dtype: torch.dtype) -> None:
    shape = (8, 4, NUM_KV_HEADS, 16)
    originals = [random_bytes(shape, dtype, seed) for seed in range(6)]  # 3 layers x (K, V)
    mapping = torch.tensor([[1, 5], [1, 6], [3, 0]])
    caches = [c.clone() for c in originals]
    ops.copy_blocks(caches[:3], caches[3:], mapping)
    expected = [c.clone() for c in originals]
    reference.copy_blocks(expected[:3], expected[3:], mapping)
    untouched = [1, 2, 3, 4, 7]
    for cache, want, before in zip(caches, expected, originals, strict=True):
        assert torch.equal(as_bytes(cache), as_bytes(want))
        assert torch.equal(as_bytes(cache[5]), as_bytes(before[1]))
        assert torch.equal(as_bytes(cache[untouched]), as_bytes(before[untouched]))
    ops.copy_blocks(caches[:3], caches[3:], torch.empty(0, 2, dtype=torch.int64))  # no-op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_blocks_preserves_every_byte(dtype: torch.dtype) -> None:
    src = random_bytes((10, 8, NUM_KV_HEADS, 16), dtype, 7)
    dst = random_bytes((6, 8, NUM_KV_HEADS, 16), dtype, 8)
    mapping = torch.tensor([[9, 0], [2, 4], [5, 1]])
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    before = dst.clone()
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(as_bytes(dst), as_bytes(expected))
    assert torch.equal(as_bytes(dst[[0, 4, 1]]), as_bytes(src[[9, 2, 5]]))
    assert torch.equal(as_bytes(dst[[2, 3, 5]]), as_bytes(before[[2, 3, 5]]))
