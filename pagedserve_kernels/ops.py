"""Typed KV-cache and paged-attention ops: CUDA kernels on GPU tensors, C++ kernels on CPU."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "paged_attention.cu", "cache_kernels.cu")
# The head sizes paged_attention.cu is instantiated for; others decode with torch ops.
CUDA_DECODE_HEAD_DIMS = (64, 128)
CPU_SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "cache.cpp",
    "linear.cpp",
    "layers.cpp",
    "sampling.cpp",
)


@functools.cache
def cuda_extension() -> ModuleType:
    """Compile (first call only; torch caches the build on disk) and import the CUDA kernels."""
    from torch.utils.cpp_extension import load

    return load(
        name=_build_name("pagedserve_kernels"),
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=[_headers_flag()],
        extra_cuda_cflags=["-O3", _headers_flag()],
    )


@functools.cache
def cpu_extension() -> ModuleType:
    """Compile (first call only; torch caches the build on disk) and import the CPU kernels.

    No -march=native: the build may be shared with other machines. The hot loops are cloned per
    instruction set inside the sources instead. -fopenmp makes at::parallel_for run on torch's
    own OpenMP threads, so torch.set_num_threads applies.
    """
    from torch.utils.cpp_extension import load

    return load(
        name=_build_name("pagedserve_cpu_kernels"),
        sources=[str(CSRC / "cpu" / name) for name in CPU_SOURCES],
        extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", _headers_flag()],
    )


def _build_name(name: str) -> str:
    """The extension's name for this checkout: torch keeps one build per name, so two
    checkouts with different sources sharing a name would rebuild over each other, each
    process waiting on the other's compile."""
    return f"{name}_{hashlib.sha256(str(CSRC).encode()).hexdigest()[:8]}"


@functools.cache
def _headers_flag() -> str:
    """A define naming the headers' content: torch rebuilds a cached extension when its
    sources or flags change, and would not notice an edited header otherwise."""
    digest = hashlib.sha256()
    for header in sorted(CSRC.rglob("*.h")):
        digest.update(header.read_bytes())
    return f"-DPAGEDSERVE_HEADERS_SHA={digest.hexdigest()[:16]}"


def reshape_and_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # [num_tokens] int64; block_id * block_size + offset, -1 = skip
) -> None:
    """Write each token's K/V into its cache slot, in place, rounded to the cache's dtype;
    tokens with slot -1 are skipped.

    Each token's [num_kv_heads, head_dim] rows must be contiguous; tokens may be strided.
    """
    ext = cuda_extension() if key_cache.is_cuda else cpu_extension()
    key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
    ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_decode(
    query: Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32, >= 1, the new token included
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_seqs, num_heads, head_dim], query's dtype
    """Attention of one new token per sequence over its whole context, read from the paged cache;
    with ``sliding_window`` > 0 over its last that many positions (itself included).

    The new token's K/V must already be in the cache, which is read in place on either device.
    The cache may be in another dtype than the query: on CPU a float32 query reads a 16-bit
    cache as it is, on GPU the query is rounded to the cache's dtype. On GPU a head size the
    kernel lacks (a toy model's 16, Gemma 3's 256) takes ``decode_by_gather``.
    """
    _group_size(query, key_cache)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if query.is_cuda and query.shape[2] not in CUDA_DECODE_HEAD_DIMS:
        return decode_by_gather(
            query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window
        )
    if query.is_cuda:
        out = cuda_extension().paged_attention_decode(
            query.to(key_cache.dtype),
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            0,
            sliding_window,
        )
        return out.to(query.dtype)
    return cpu_extension().paged_attention(
        query, key_cache, value_cache, block_tables, context_lens, None, scale, sliding_window
    )


def paged_attention_prefill(
    query: Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative offsets into query
    context_lens: Tensor,  # [num_seqs] int32, cached prefix + new tokens
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its cached prefix and themselves;
    with ``sliding_window`` > 0 a token sees only the last that many positions (itself included).

    One sequence, context_len = 7, q_len = 3 (its K/V already written to the cache):

        position   0 1 2 3 | 4 5 6
                   cached    new: query rows 0..2, row i sees positions <= 7 - 3 + i

    On CPU the cache is read in place; a float32 query may read a 16-bit cache. On GPU (no CUDA
    prefill kernel yet) see ``prefill_by_gather``.
    """
    _group_size(query, key_cache)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if query.is_cuda:
        return prefill_by_gather(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
        )
    return cpu_extension().paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        sliding_window,
    )


def prefill_by_gather(
    query: Tensor,  # [num_tokens, num_heads, head_dim], sequences concatenated
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: Tensor,  # [num_seqs + 1] int32, cumulative offsets into query
    context_lens: Tensor,  # [num_seqs] int32, cached prefix + new tokens
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_attention_prefill`` with torch ops on any device (the GPU's path): sequences
    padded to one batch with two index ops (context, queries) and one attention call, in the
    cache's dtype; the padded rows are dropped again at the end. Each sequence's context is
    gathered from the block its first new token's window starts in, so entries before it
    (-1 once the scheduler freed them) are never read.
    """
    group = _group_size(query, key_cache)
    num_heads, head_dim = query.shape[1:]
    num_seqs, num_kv_heads = context_lens.shape[0], key_cache.shape[2]
    dtype, query = query.dtype, query.to(key_cache.dtype)
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    first_pos = context_lens.long() - q_lens  # [num_seqs], each sequence's first new token
    keys, values, positions = _gather_context(
        key_cache, value_cache, block_tables, context_lens, _window_start(first_pos, sliding_window)
    )
    max_q = int(q_lens.max())
    rows = torch.arange(max_q, device=query.device)
    valid = rows < q_lens[:, None]  # [num_seqs, max_q]
    q = query.index_select(0, torch.where(valid, starts[:, None] + rows, 0).flatten())
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    q_pos = (first_pos[:, None] + rows)[:, :, None]  # [num_seqs, max_q, 1]
    # Padded rows attend everywhere so that they stay finite; they are dropped below.
    allowed = positions[:, None, :] <= q_pos
    if sliding_window > 0:
        allowed &= positions[:, None, :] > q_pos - sliding_window
    allowed |= ~valid[:, :, None]  # [num_seqs, max_q, max_ctx]
    mask = allowed[:, None, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, num_heads, head_dim)[valid].to(dtype)


def decode_by_gather(
    query: Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32, >= 1, the new token included
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_seqs, num_heads, head_dim]
    """``paged_attention_decode`` with torch ops on any device: a decode is a prefill of one
    new token per sequence."""
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return prefill_by_gather(
        query, key_cache, value_cache, block_tables, starts, context_lens, scale, sliding_window
    )


def _window_start(position: Tensor, sliding_window: int) -> Tensor:
    """The first position a token at ``position`` sees."""
    if sliding_window == 0:
        return torch.zeros_like(position)
    return (position - sliding_window + 1).clamp(min=0)


def copy_blocks(
    key_caches: list[Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy block src to dst in every layer's caches (copy-on-write), in place.

    No block may be both a source and a destination in one mapping.
    """
    if not key_caches or block_mapping.numel() == 0:
        return
    device = key_caches[0].device
    mapping = block_mapping.to(device=device, dtype=torch.int64)
    if device.type == "cuda":
        cuda_extension().copy_blocks(key_caches, value_caches, mapping.contiguous())
        return
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(
    src: Tensor,  # [num_blocks, ...] one cache tensor
    dst: Tensor,  # [num_blocks, ...] same block shape and dtype, possibly on another device
    block_mapping: Tensor,  # [num_pairs, 2] int64 (src_block, dst_block)
) -> None:
    """Copy blocks between two cache tensors (GPU <-> CPU swap) as one batched copy, in place."""
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(device=src.device, dtype=torch.int64)
    dst_ids = block_mapping[:, 1].to(device=dst.device, dtype=torch.int64)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))


def _group_size(
    query: Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> int:
    """Query heads per kv head; raises ValueError when the shapes cannot be paired."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape[3] != head_dim:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} kv heads "
            f"of size {key_cache.shape[3]}"
        )
    return num_heads // num_kv_heads


def _gather_context(
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32
    first_seen: Tensor,  # [num_seqs] int64, the earliest position a new token sees
) -> tuple[Tensor, Tensor, Tensor]:
    """Each sequence's blocks from the one holding ``first_seen`` to its last, laid out
    contiguously (one index op per cache) and padded with block 0; and the position of each
    gathered row.

        table:     [ -1 | -1 | b2 | b3 | b4 ]     first_seen in b2
        gathered:  [ b2 | b3 | b4 | 0 (pad) ]     positions 2B .. 6B-1

    Returns keys and values as 2 x [num_seqs, num_kv_heads, max_ctx, head_dim], and
    positions as [num_seqs, max_ctx] int64.
    """
    block_size = key_cache.shape[1]
    num_seqs, width = block_tables.shape
    first_block = first_seen // block_size
    end_block = (context_lens.long() + block_size - 1) // block_size
    num_blocks = int((end_block - first_block).max())
    cols = first_block[:, None] + torch.arange(num_blocks, device=block_tables.device)
    ids = block_tables.gather(1, cols.clamp(max=width - 1)).long()
    ids = torch.where(cols < end_block[:, None], ids, 0).flatten()
    # index_select rather than cache[ids]: the quicker gather of whole blocks on CPU
    keys, values = (
        cache.index_select(0, ids).view(num_seqs, num_blocks * block_size, *cache.shape[2:])
        for cache in (key_cache, value_cache)
    )
    offsets = torch.arange(num_blocks * block_size, device=block_tables.device)
    positions = first_block[:, None] * block_size + offsets
    return keys.transpose(1, 2), values.transpose(1, 2), positions
