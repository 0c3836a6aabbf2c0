"""Random paged KV caches for kernel tests: scattered block tables and poisoned unused slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

POISON = 100.0  # fills every slot no sequence owns: reading one would swamp the softmax


@dataclass(slots=True)
class PagedKV:
    key_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32, padding -> the poisoned block 0
    context_lens: Tensor  # [num_seqs] int32


def make_paged_kv(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedKV:
    """Caches whose sequences own shuffled, non-contiguous blocks; block 0 is owned by none."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    owned = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for seq, (n, count) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids, owned = owned[:count], owned[count:]
        tables[seq, :count] = torch.tensor(ids, dtype=torch.int32)
        slots = [ids[pos // block_size] * block_size + pos % block_size for pos in range(n)]
        used.view(-1)[slots] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    for cache in caches:
        cache[~used] = POISON
    key_cache, value_cache = (c.to(device=device, dtype=dtype) for c in caches)
    return PagedKV(
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads included) to check byte-exact copies."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen)
    return raw.to(torch.uint8).view(dtype)


def as_bytes(t: Tensor) -> Tensor:
    """The raw bytes of a contiguous tensor, for exact comparison regardless of NaNs."""
    return t.contiguous().view(torch.uint8)


def free_outside_window(
    block_tables: Tensor,  # [num_seqs, max_num_blocks] int32
    first_positions: list[int],
    block_size: int,
    window: int,
) -> Tensor:  # a copy, freed entries -1
    """The tables as the scheduler leaves them under a sliding window: each sequence's
    entries wholly before the window of its first new token, at ``first_positions``, are -1
    (what a kernel must never read)."""
    tables = block_tables.clone()
    for seq, first in enumerate(first_positions):
        tables[seq, : max(0, first - window + 1) // block_size] = -1
    return tables
