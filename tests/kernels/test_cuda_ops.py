"""CUDA kernels against the naive reference over many shapes (skipped without a GPU).

Tolerances: kernel and reference accumulate in >= fp32 from the same inputs and round the output
once, so they differ by about one unit in the last place of the output dtype:
fp32 atol 5e-5 rtol 1e-4, fp16 atol 2e-3 rtol 2e-3, bf16 atol 1.6e-2 rtol 1.6e-2.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import ops, reference
from tests.kernels.cases import PagedKV, as_bytes, free_outside_window, make_paged_kv, random_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
NUM_KV_HEADS = 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: {"atol": 5e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return ops.cuda_extension()


def _query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)


def _reference_decode(query: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """The reference on CPU copies (its per-token loops are faster there)."""
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens)
    return reference.paged_attention_decode(*(t.cpu() for t in args), scale).to(DEVICE)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(
    ext: ModuleType, dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> None:
    contexts = [1, 5, block_size, block_size + 1, 513, 1500, 4096]
    kv = make_paged_kv(
        contexts, block_size, NUM_KV_HEADS, head_dim, dtype=dtype, device=DEVICE, seed=block_size
    )
    query = _query(len(contexts), NUM_KV_HEADS * group, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    expected = _reference_decode(query, kv, scale)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, scale)
    torch.testing.assert_close(ops.paged_attention_decode(*args), expected, **TOL[dtype])
    capacity = kv.block_tables.shape[1] * block_size
    # one pass over the whole context, the default split, and many small partitions
    for partition_size in (capacity, 512, 2 * block_size):
        out = ext.paged_attention_decode(*args, partition_size)
        assert out.dtype == dtype
        torch.testing.assert_close(
            out, expected, **TOL[dtype], msg=lambda m, p=partition_size: f"partition {p}: {m}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_context_for_long_sequences(ext: ModuleType, dtype: torch.dtype) -> None:
    """Few long sequences: the automatic choice splits the context and reduces the partials."""
    kv = make_paged_kv([4096, 4000, 2049], 16, 1, 128, dtype=dtype, device=DEVICE, seed=5)
    query = _query(3, 8, 128, dtype)
    expected = _reference_decode(query, kv, 0.1)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.1)
    for partition_size in (0, 256, 512, 1024):
        out = ext.paged_attention_decode(*args, partition_size)
        torch.testing.assert_close(out, expected, **TOL[dtype])


def test_decode_reads_strided_query(ext: ModuleType) -> None:
    """A query sliced out of a fused qkv projection is read in place."""
    kv = make_paged_kv([33, 300], 16, NUM_KV_HEADS, 64, device=DEVICE)
    qkv = _query(2, 4 + 2 * NUM_KV_HEADS, 64, torch.float32).flatten(1)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    out = ops.paged_attention_decode(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125
    )
    torch.testing.assert_close(out, _reference_decode(query, kv, 0.125), **TOL[torch.float32])


def test_unsupported_head_dim_is_rejected(ext: ModuleType) -> None:
    kv = make_paged_kv([8], 8, 1, 96, device=DEVICE)
    query = _query(1, 1, 96, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim"):
        ext.paged_attention_decode(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.1, 0
        )


@pytest.mark.parametrize("head_dim", [16, 96, 256])
def test_decode_of_other_head_sizes_takes_the_torch_path(head_dim: int) -> None:
    kv = make_paged_kv([1, 300, 1000], 16, NUM_KV_HEADS, head_dim, device=DEVICE, seed=3)
    query = _query(3, 2 * NUM_KV_HEADS, head_dim, torch.float32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.1)
    torch.testing.assert_close(
        ops.paged_attention_decode(*args), _reference_decode(query, kv, 0.1), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    seqs = [(1, 1), (300, 300), (1000, 17)]
    kv = make_paged_kv([c for c, _ in seqs], 16, NUM_KV_HEADS, 128, dtype=dtype, device=DEVICE)
    q_lens = torch.tensor([q for _, q in seqs])
    starts = F.pad(q_lens.cumsum(0), (1, 0)).to(DEVICE, torch.int32)
    query = _query(int(q_lens.sum()), 8, 128, dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.context_lens)
    out = ops.paged_attention_prefill(*args, 0.09)
    expected = reference.paged_attention_prefill(*(t.cpu() for t in args), 0.09)
    torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])


# Element offset of key/value inside a fused row: 0 -> 16-byte words, 2 -> 4-byte, 1 -> bytes.
@pytest.mark.parametrize("offset", [0, 2, 1])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache(dtype: torch.dtype, block_size: int, offset: int) -> None:
    num_tokens, row = 50, NUM_KV_HEADS * 64
    num_blocks = -(-num_tokens // block_size) + 2
    fused = random_bytes((num_tokens, offset + 2 * row), dtype, 1).to(DEVICE)
    key = fused[:, offset : offset + row].view(num_tokens, NUM_KV_HEADS, 64)
    value = fused[:, offset + row :].view(num_tokens, NUM_KV_HEADS, 64)
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    shape = (num_blocks, block_size, NUM_KV_HEADS, 64)
    caches = [random_bytes(shape, dtype, seed).to(DEVICE) for seed in (3, 4)]
    expected = [c.cpu() for c in caches]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots.to(DEVICE))
    reference.reshape_and_cache(key.cpu(), value.cpu(), expected[0], expected[1], slots)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(as_bytes(got.cpu()), as_bytes(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_all_layers_in_one_call(dtype: torch.dtype) -> None:
    shape = (12, 16, NUM_KV_HEADS, 64)
    originals = [random_bytes(shape, dtype, seed) for seed in range(8)]  # 4 layers x (K, V)
    caches = [c.to(DEVICE) for c in originals]
    mapping = torch.tensor([[0, 7], [0, 8], [3, 11], [5, 1]])
    ops.copy_blocks(caches[:4], caches[4:], mapping)
    reference.copy_blocks(originals[:4], originals[4:], mapping)
    for got, want in zip(caches, originals, strict=True):
        assert torch.equal(as_bytes(got.cpu()), as_bytes(want))


@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks_between_devices(direction: str) -> None:
    gpu = random_bytes((10, 16, NUM_KV_HEADS, 64), torch.float16, 1).to(DEVICE)
    cpu = random_bytes((6, 16, NUM_KV_HEADS, 64), torch.float16, 2)
    src, dst = (gpu, cpu) if direction == "out" else (cpu, gpu)
    mapping = torch.tensor([[1, 2], [4, 0], [5, 5]])
    expected = dst.cpu()
    reference.swap_blocks(src.cpu(), expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(as_bytes(dst.cpu()), as_bytes(expected))


@pytest.mark.parametrize("window", [7, 16, 600])
def test_sliding_window_on_cuda_matches_reference(ext: ModuleType, window: int) -> None:
    """Decode in one pass and in partitions wholly before the window; prefill's mask. The
    entries wholly before each first new token's window are -1, as the scheduler leaves
    them: neither pass reads them."""
    kv = make_paged_kv([5, 300, 4096], 16, NUM_KV_HEADS, 128, device=DEVICE, seed=9)
    query = _query(3, 8, 128, torch.float32)
    tables = free_outside_window(kv.block_tables, [4, 299, 4095], 16, window)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.context_lens)
    expected = reference.paged_attention_decode(*(t.cpu() for t in args), 0.1, window)
    for partition_size in (0, 64, 4096):
        out = ext.paged_attention_decode(*args, 0.1, partition_size, window)
        torch.testing.assert_close(out.cpu(), expected, **TOL[torch.float32])
    # whole prompts of 5 and 300 tokens, 17 new tokens after 4079 cached ones
    tables = free_outside_window(kv.block_tables, [0, 0, 4079], 16, window)
    starts = torch.tensor([0, 5, 305, 322], dtype=torch.int32, device=DEVICE)
    prefill_args = (_query(322, 8, 128, torch.float32), *args[1:3], tables, starts, kv.context_lens)
    out = ops.paged_attention_prefill(*prefill_args, 0.1, window)
    expected = reference.paged_attention_prefill(*(t.cpu() for t in prefill_args), 0.1, window)
    torch.testing.assert_close(out.cpu(), expected, **TOL[torch.float32])
