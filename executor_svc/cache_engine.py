"""The paged KV pool ("gpu": on the accelerator, or host memory on a CPU executor) and the
CPU swap pool, per layer, with the batched block operations the scheduler asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc import host_memory
from pagedserve.step import BlockPairs
from pagedserve_kernels import ops

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        elements = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return elements * torch.empty((), dtype=self.dtype).element_size()

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


class CacheEngine:
    """Owns the pool tensors; every operation takes a whole step's block pairs at once."""

    def __init__(
        self, shape: CacheShape, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_gpu_blocks}")
        self.shape = shape
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        pin = device.type == "cuda"
        self.gpu_cache = self._allocate(num_gpu_blocks, device, pin=False)
        self.cpu_cache = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin)

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> list[KVCache]:
        s = self.shape
        dims = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

        def make() -> torch.Tensor:
            if device.type == "cpu" and not pin:
                return host_memory.zeros(dims, s.dtype)
            return torch.zeros(dims, dtype=s.dtype, device=device, pin_memory=pin)

        return [(make(), make()) for _ in range(s.num_layers)]

    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy ``(gpu, cpu)`` block pairs from the KV pool to the swap pool."""
        self._swap(self.gpu_cache, self.cpu_cache, pairs)

    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy ``(cpu, gpu)`` block pairs from the swap pool back to the KV pool."""
        self._swap(self.cpu_cache, self.gpu_cache, pairs)

    def copy(self, pairs: BlockPairs) -> None:
        """Apply a step's copy-on-write ``(src, dst)`` pairs in the KV pool, all layers."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache], mapping)

    def _swap(self, src: list[KVCache], dst: list[KVCache], pairs: BlockPairs) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst, strict=True):
            ops.swap_blocks(src_k, dst_k, mapping)
            ops.swap_blocks(src_v, dst_v, mapping)
