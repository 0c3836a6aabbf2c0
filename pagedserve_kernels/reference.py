"""Naive, loop-per-token reference versions of pagedserve_kernels.ops, computed in float64
(tests only)."""

from __future__ import annotations

import torch
from torch import Tensor


def reshape_and_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write token i's K/V at (slot // block_size, slot % block_size), one token at a time."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        key_cache[block_id, offset] = key[token]
        value_cache[block_id, offset] = value[token]


def _context(
    cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: list[int],
    first: int,
    context_len: int,
) -> Tensor:  # [context_len - first, num_kv_heads, head_dim] float64
    """Positions first..context_len-1 of one sequence, read token by token through its block
    table (entries before them may be -1: freed)."""
    block_size = cache.shape[1]
    rows = []
    for pos in range(first, context_len):
        block_id = block_table[pos // block_size]
        assert block_id >= 0, f"position {pos} is read but its block was freed"
        rows.append(cache[block_id, pos % block_size])
    return torch.stack(rows).double()


def _attend(
    query: Tensor,  # [num_heads, head_dim]
    keys: Tensor,  # [n, num_kv_heads, head_dim]
    values: Tensor,  # [n, num_kv_heads, head_dim]
    scale: float,
) -> Tensor:  # [num_heads, head_dim] float64
    """Softmax attention of each query head over all n positions of its kv head."""
    num_heads, num_kv_heads = query.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for head in range(num_heads):
        k, v = keys[:, head // group], values[:, head // group]
        scores = (k @ query[head].double()) * scale
        probs = torch.exp(scores - scores.max())
        out[head] = (probs / probs.sum()) @ v
    return out


def paged_attention_decode(
    query: Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    context_lens: Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_seqs, num_heads, head_dim]
    """The new token of each sequence attends to all context_len positions, or to the last
    ``sliding_window`` of them."""
    out = torch.empty_like(query)
    for seq, (table, context_len) in enumerate(
        zip(block_tables.tolist(), context_lens.tolist(), strict=True)
    ):
        first = _window_start(context_len - 1, sliding_window)
        keys = _context(key_cache, table, first, context_len)
        values = _context(value_cache, table, first, context_len)
        out[seq] = _attend(query[seq], keys, values, scale).to(query.dtype)
    return out


def paged_attention_prefill(
    query: Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: Tensor,  # [num_seqs + 1] int32
    context_lens: Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int = 0,
) -> Tensor:  # [num_tokens, num_heads, head_dim]
    """New token i of a sequence (position context_len - q_len + i) sees positions <= its own
    (and, with a sliding window, the last ``sliding_window`` of them)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, (table, context_len) in enumerate(
        zip(block_tables.tolist(), context_lens.tolist(), strict=True)
    ):
        q_len = starts[seq + 1] - starts[seq]
        if q_len == 0:
            continue
        base = _window_start(context_len - q_len, sliding_window)  # what the first token sees
        keys = _context(key_cache, table, base, context_len)
        values = _context(value_cache, table, base, context_len)
        for i in range(q_len):
            pos = context_len - q_len + i
            token = starts[seq] + i
            first = _window_start(pos, sliding_window) - base
            seen = slice(first, pos + 1 - base)
            attended = _attend(query[token], keys[seen], values[seen], scale)
            out[token] = attended.to(query.dtype)
    return out


def _window_start(pos: int, sliding_window: int) -> int:
    """The first position the token at ``pos`` sees."""
    return max(0, pos - sliding_window + 1) if sliding_window > 0 else 0


def copy_blocks(
    key_caches: list[Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[Tensor],  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy each (src, dst) pair in each cache, one block at a time."""
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst].copy_(cache[src])


def swap_blocks(
    src: Tensor,  # [num_blocks, ...]
    dst: Tensor,  # [num_blocks, ...]
    block_mapping: Tensor,  # [num_pairs, 2] int64 (src_block, dst_block)
) -> None:
    """Copy each (src_block, dst_block) pair across tensors, one block at a time."""
    for src_block, dst_block in block_mapping.tolist():
        dst[dst_block].copy_(src[src_block])


def linear(
    x: Tensor,  # [num_tokens, in_features]
    weight: Tensor,  # [out_features, in_features]
    bias: Tensor | None = None,  # [out_features]
) -> Tensor:  # [num_tokens, out_features]
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # x: [num_tokens, hidden]
    xd = x.double()
    return (weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_and_mul(gate_up: Tensor) -> Tensor:  # [num_tokens, 2 * width] -> [num_tokens, width]
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (gate / (1 + torch.exp(-gate)) * up).to(gate_up.dtype)


def rotary_embedding(
    positions: Tensor,  # [num_tokens] int64
    query: Tensor,  # [num_tokens, num_heads, head_dim]
    key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: Tensor,  # [max_positions, head_dim]
    sin: Tensor,  # [max_positions, head_dim]
) -> tuple[Tensor, Tensor]:
    """Each head's halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), token by token."""
    half = query.shape[-1] // 2
    rotated = []
    for x in (query, key):
        out = torch.empty(x.shape, dtype=torch.float64)
        for token, pos in enumerate(positions.tolist()):
            c, s = cos[pos, :half].double(), sin[pos, :half].double()
            x1, x2 = x[token, :, :half].double(), x[token, :, half:].double()
            out[token, :, :half] = x1 * c - x2 * s
            out[token, :, half:] = x2 * c + x1 * s
        rotated.append(out.to(x.dtype))
    return rotated[0], rotated[1]
