"""Per-step attention metadata and the paged attention layer that reads the KV pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve_kernels import ops


@dataclass(slots=True)
class AttentionMetadata:
    """Where a flat batch's tokens live in the paged cache; built once per step.

    The batch holds the prefill sequences' new tokens first, then one token per decode
    sequence:

        tokens:  [ prefill seq 0 | prefill seq 1 | ... ][ d0 d1 d2 ... ]
                  <---- num_prefill_tokens ------------><- num_decode ->
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    num_prefill_tokens: int
    prefill_query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int32
    prefill_context_lens: torch.Tensor  # [num_prefill_seqs] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode_seqs] int32
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int32


class PagedAttention(nn.Module):
    """Writes the step's K/V into their slots, then attends through the block tables."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int = 0,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window  # positions a token sees, itself included; 0: all

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        split = meta.num_prefill_tokens
        parts = []
        if split > 0:
            parts.append(
                ops.paged_attention_prefill(
                    query[:split],
                    key_cache,
                    value_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_context_lens,
                    self.scale,
                    self.sliding_window,
                )
            )
        if split < query.shape[0]:
            parts.append(
                ops.paged_attention_decode(
                    query[split:],
                    key_cache,
                    value_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    self.sliding_window,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
