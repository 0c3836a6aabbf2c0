"""CPU kernels of pagedserve_kernels.ops (the C++ extension) against the naive reference.

Tolerances: both accumulate in >= fp32 from the same inputs and round the output once:
fp32 atol 1e-5 rtol 1e-4, fp16 atol 2e-3 rtol 2e-3, bf16 atol 1.6e-2 rtol 1.6e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import ops, reference
from pagedserve_kernels.ops import cpu_extension
from tests.kernels.cases import as_bytes, free_outside_window, make_paged_kv, random_bytes

NUM_KV_HEADS = 2
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def _query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)


def _decode_inputs(
    context_lens: list[int], block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    kv = make_paged_kv(context_lens, block_size, NUM_KV_HEADS, head_dim, dtype=dtype, seed=group)
    query = _query(len(context_lens), NUM_KV_HEADS * group, head_dim, dtype)
    return (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_decode_matches_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    # a single token, partial / exact / one-past last blocks, long contexts
    context_lens = [1, block_size - 1, block_size, block_size + 1, 97, 1500, 4096]
    args = _decode_inputs(context_lens, block_size, head_dim, group, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention_decode(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.paged_attention_decode(*args, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_of_a_large_batch_matches_reference(dtype: torch.dtype) -> None:
    """Enough sequences that each CPU work item takes all kv heads of one sequence."""
    context_lens = [1 + (37 * i) % 700 for i in range(48)]
    args = _decode_inputs(context_lens, 16, 64, 3, dtype)
    out = ops.paged_attention_decode(*args, 0.125)
    torch.testing.assert_close(out, reference.paged_attention_decode(*args, 0.125), **TOL[dtype])


def test_decode_sharp_softmax_matches_reference() -> None:
    """Large logits: the running max moves block to block and the rescaling must be exact."""
    query, *rest = _decode_inputs([5, 300, 2000], 16, 64, 3, torch.float32)
    args = (query * 8, *rest)
    torch.testing.assert_close(
        ops.paged_attention_decode(*args, 0.125),
        reference.paged_attention_decode(*args, 0.125),
        **TOL[torch.float32],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("context_lens", [[4096], [130, 2001]], ids=str)
def test_decode_of_a_small_batch_merges_the_parts_of_each_context(
    context_lens: list[int], dtype: torch.dtype
) -> None:
    """Too few sequences for the threads: each context is read in parts whose softmax results
    are merged; large logits give the parts different maxima."""
    query, *rest = _decode_inputs(context_lens, 16, 64, 3, dtype)
    args = (query * 4, *rest)
    torch.testing.assert_close(
        ops.paged_attention_decode(*args, 0.125),
        reference.paged_attention_decode(*args, 0.125),
        **TOL[dtype],
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"),
    [
        (8, 64, 1),
        (8, 128, 4),
        (16, 64, 3),
        (16, 128, 4),
        (32, 64, 1),
        (32, 128, 3),
        (64, 64, 4),
        (128, 128, 3),
        (16, 16, 2),  # a toy model's heads: one vector of 16
        (16, 256, 1),  # Gemma 3's: four chunks of four vectors
    ],
)
def test_prefill_matches_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    # whole prompts (one spanning several query tiles and blocks), a chunk after a cached
    # prefix, single tokens, an exact block, an empty chunk
    seqs = [(1, 1), (37, 37), (300, 9), (50, 1), (block_size, block_size), (2 * block_size, 3)]
    seqs += [(200, 130), (5, 0)]
    args = _prefill_inputs(seqs, block_size, head_dim, group, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention_prefill(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.paged_attention_prefill(*args, scale), **TOL[dtype])


@pytest.mark.parametrize("window", [1, 5, 16, 40, 333])
def test_sliding_window_matches_reference(window: int) -> None:
    """Windows inside a block, on a block boundary, across blocks, past short contexts; decode
    batches small enough that a long context is read in parts (from its window's block)."""
    seqs = [(1, 1), (37, 37), (300, 9), (50, 1), (200, 130), (1000, 64)]
    args = _prefill_inputs(seqs, 16, 64, 3, torch.float32)
    out = ops.paged_attention_prefill(*args, 0.125, sliding_window=window)
    expected = reference.paged_attention_prefill(*args, 0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    for context_lens in ([4096], [3, 130, 2001], [1 + (37 * i) % 700 for i in range(48)]):
        query, *rest = _decode_inputs(context_lens, 16, 64, 3, torch.float32)
        args = (query * 4, *rest)
        out = ops.paged_attention_decode(*args, 0.125, sliding_window=window)
        expected = reference.paged_attention_decode(*args, 0.125, sliding_window=window)
        torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("head_dim", [16, 96, 256])
def test_decode_by_gather_matches_reference(head_dim: int, window: int) -> None:
    """The GPU's path for head sizes its kernel lacks (a toy model's 16, Gemma 3's 256)."""
    context_lens = [1, 17, 300, 1000]
    query, key_cache, value_cache, tables, lens = _decode_inputs(
        context_lens, 16, head_dim, 3, torch.float32
    )
    if window:
        tables = free_outside_window(tables, [n - 1 for n in context_lens], 16, window)
    args = (query, key_cache, value_cache, tables, lens, head_dim**-0.5, window)
    out = ops.decode_by_gather(*args)
    torch.testing.assert_close(out, reference.paged_attention_decode(*args), **TOL[torch.float32])


@pytest.mark.parametrize("window", [1, 16, 40])
def test_sliding_window_skips_freed_blocks(window: int) -> None:
    """Entries wholly before each first new token's window are -1 (freed by the scheduler):
    decode, prefill and the GPU's gather path never read them and answer as before."""
    seqs = [(1, 1), (300, 9), (200, 130), (1000, 64), (37, 0)]
    query, key_cache, value_cache, tables, starts, context_lens = _prefill_inputs(
        seqs, 16, 64, 3, torch.float32
    )
    freed = free_outside_window(tables, [c - q for c, q in seqs], 16, window)
    assert (freed == -1).any()
    kept = (query, key_cache, value_cache, tables, starts, context_lens)
    args = (query, key_cache, value_cache, freed, starts, context_lens)
    expected = ops.paged_attention_prefill(*kept, 0.125, sliding_window=window)
    for prefill in (
        ops.paged_attention_prefill,
        ops.prefill_by_gather,
        reference.paged_attention_prefill,
    ):
        out = prefill(*args, 0.125, sliding_window=window)
        torch.testing.assert_close(out, expected, **TOL[torch.float32])
    context_lens = [4096, 3, 130, 2001]
    query, key_cache, value_cache, tables, lens = _decode_inputs(
        context_lens, 16, 64, 3, torch.float32
    )
    freed = free_outside_window(tables, [n - 1 for n in context_lens], 16, window)
    expected = ops.paged_attention_decode(
        query, key_cache, value_cache, tables, lens, 0.125, window
    )
    for decode in (ops.paged_attention_decode, reference.paged_attention_decode):
        out = decode(query, key_cache, value_cache, freed, lens, 0.125, window)
        torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_freed_block_inside_the_window_is_refused() -> None:
    """A -1 the window reaches is a bad table: the CPU kernel says so instead of reading."""
    query, key_cache, value_cache, tables, lens = _decode_inputs([100], 16, 64, 3, torch.float32)
    tables[0, 4] = -1  # positions 64..79, inside the window of position 99
    with pytest.raises(RuntimeError, match="block id -1 is not in the cache"):
        ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, 40)


def test_float16_keeps_dtype_and_matches() -> None:
    dtype = torch.float16
    args = _prefill_inputs([(70, 70), (130, 4)], 16, 64, 2, dtype)
    out = ops.paged_attention_prefill(*args, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.paged_attention_prefill(*args, 0.125), **TOL[dtype])
    decode_args = _decode_inputs([5, 200], 16, 64, 2, dtype)
    out = ops.paged_attention_decode(*decode_args, 0.125)
    assert out.dtype == dtype
    expected = reference.paged_attention_decode(*decode_args, 0.125)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_query_reads_a_16_bit_cache(cache_dtype: torch.dtype) -> None:
    # fp32 activations over a bf16 / fp16 pool (--kv-cache-dtype): the cache's values are
    # widened exactly, so the fp32 tolerance holds against the reference on the same cache.
    args = _prefill_inputs([(70, 70), (130, 4), (300, 1)], 16, 64, 2, cache_dtype)
    args = (args[0].float(), *args[1:])
    out = ops.paged_attention_prefill(*args, 0.125)
    assert out.dtype == torch.float32
    expected = reference.paged_attention_prefill(*args, 0.125)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    for context_lens in ([5, 200], [1000]):  # the second cuts its context into parts
        query, *rest = _decode_inputs(context_lens, 16, 64, 2, cache_dtype)
        decode_args = (query.float(), *rest)
        out = ops.paged_attention_decode(*decode_args, 0.125)
        expected = reference.paged_attention_decode(*decode_args, 0.125)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_attention_refuses_a_16_bit_query_over_another_cache() -> None:
    query, *rest = _decode_inputs([5], 16, 64, 2, torch.float16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_attention_decode(query.bfloat16(), *rest, 0.125)


def test_reshape_and_cache_rounds_to_the_cache_dtype() -> None:
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(2, 3, NUM_KV_HEADS, 64, generator=gen)
    key_cache, value_cache = torch.zeros(2, 2, 8, NUM_KV_HEADS, 64, dtype=torch.bfloat16)
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([9, -1, 0]))
    rows_k, rows_v = key_cache.view(-1, NUM_KV_HEADS, 64), value_cache.view(-1, NUM_KV_HEADS, 64)
    assert torch.equal(rows_k[[9, 0]], key[[0, 2]].bfloat16())
    assert torch.equal(rows_v[[9, 0]], value[[0, 2]].bfloat16())


def test_thread_count_does_not_change_results() -> None:
    """Work items are split among threads whole, so any thread count gives the same bits."""
    args = _prefill_inputs([(300, 60), (1000, 1), (40, 40)], 16, 64, 3, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ops.paged_attention_prefill(*args, 0.125)
        torch.set_num_threads(max(2, threads))
        multi = ops.paged_attention_prefill(*args, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


@pytest.mark.parametrize("vector_floats", [0, 8])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_a_prompts_result_does_not_depend_on_how_it_was_chunked(
    group: int, window: int, vector_floats: int
) -> None:
    """A 45-token prompt in one call gives the bits of the same prompt in chunks of 2 to 17
    tokens, each after the ones before it (chunked prefill, a cached prefix): the chunks cut the
    prompt into other query tiles, and each row's sums run in the same order either way."""
    query, key_cache, value_cache, tables, _, context_lens = _prefill_inputs(
        [(45, 45)], 16, 64, group, torch.float32
    )
    chunks = [2, 3, 5, 7, 11, 17]
    ends = torch.tensor(chunks).cumsum(0).to(torch.int32)
    ext = cpu_extension()
    whole = ext.paged_attention(
        query,
        key_cache,
        value_cache,
        tables,
        context_lens,
        torch.tensor([0, 45], dtype=torch.int32),
        0.125,
        window,
        vector_floats,
    )
    chunked = ext.paged_attention(
        query,
        key_cache,
        value_cache,
        tables.expand(len(chunks), -1).contiguous(),
        ends,
        torch.cat([torch.zeros(1, dtype=torch.int32), ends]),
        0.125,
        window,
        vector_floats,
    )
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(8, 40, 3), (16, 64, 3), (32, 128, 4)]
)
def test_prefill_on_8_float_vectors_matches_reference(
    block_size: int, head_dim: int, group: int, window: int, dtype: torch.dtype
) -> None:
    """The 8-float tile path, which AVX-512 machines take only for head sizes that are not a
    multiple of 16 (40 here) and which AVX2 machines take for all."""
    seqs = [(1, 1), (37, 37), (300, 9), (50, 1), (200, 130), (5, 0)]
    args = _prefill_inputs(seqs, block_size, head_dim, group, dtype)
    query, key_cache, value_cache, tables, query_start_loc, context_lens = args
    out = cpu_extension().paged_attention(
        query, key_cache, value_cache, tables, context_lens, query_start_loc, 0.125, window, 8
    )
    expected = reference.paged_attention_prefill(*args, 0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_decode_reads_strided_query() -> None:
    """A query sliced out of a fused qkv projection is read in place."""
    kv = make_paged_kv([33, 300], 16, NUM_KV_HEADS, 64)
    qkv = _query(2, 4 + 2 * NUM_KV_HEADS, 64, torch.float32).flatten(1)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens)
    expected = reference.paged_attention_decode(*args, 0.125)
    torch.testing.assert_close(ops.paged_attention_decode(*args, 0.125), expected)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(
    block_size: int, dtype: torch.dtype
) -> None:
    num_blocks, num_tokens = 6, 2 * block_size + 3
    gen = torch.Generator().manual_seed(3)
    # key and value sliced out of one fused projection, as the model hands them over
    kv = torch.randn(num_tokens, 2, NUM_KV_HEADS, 64, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    caches = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, 64, generator=gen).to(dtype)
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


def test_reshape_and_cache_rejects_slot_outside_cache() -> None:
    key = torch.zeros(2, NUM_KV_HEADS, 64)
    cache = torch.zeros(2, 8, NUM_KV_HEADS, 64)
    with pytest.raises(RuntimeError, match="not in the cache"):
        ops.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([3, 16]))


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
