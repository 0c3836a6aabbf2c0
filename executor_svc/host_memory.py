"""Host memory for the KV pool and the weights on a CPU executor, backed by transparent
huge pages.

Paged attention reads blocks scattered over a pool of hundreds of MB: with 4 KiB pages each
block's rows cost TLB misses and page walks, and the kernel stalls on them; 2 MiB pages
spare most of those. Every decode step also streams all the weights, which huge pages spare
in the same way. Linux only; elsewhere the memory is plain.

The activations of a long prefill are another matter: see keep_freed_memory.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

_HUGE_PAGE = 2 << 20
_CACHE_LINE = 64
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = (1 << 31) - 1


def zeros(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory was advised for huge pages before its first touch."""
    tensor = torch.empty(dims, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()


def pack_parameters(module: torch.nn.Module) -> None:
    """Move the module's parameters into one huge-page buffer per dtype, as views of it.

    Tied parameters stay tied: ``parameters()`` yields a shared one once.
    """
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param in module.parameters():
        by_dtype.setdefault(param.dtype, []).append(param)
    for dtype, params in by_dtype.items():
        align = _CACHE_LINE // dtype.itemsize  # each parameter starts on a cache line
        sizes = [-(-p.numel() // align) * align for p in params]
        flat = torch.empty(sum(sizes), dtype=dtype)
        advise_huge_pages(flat)
        offset = 0
        for param, size in zip(params, sizes, strict=True):
            view = flat[offset : offset + param.numel()].view_as(param)
            param.data = view.copy_(param.data)
            offset += size


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole pages of the tensor's storage; False where the
    platform or the kernel says no. Pages already touched stay small until khugepaged."""
    libc = _libc()
    storage = tensor.untyped_storage()
    end = storage.data_ptr() + storage.nbytes()
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    if libc is None or end - start < _HUGE_PAGE:
        return False
    length = (end - start) // mmap.PAGESIZE * mmap.PAGESIZE
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def keep_freed_memory() -> bool:
    """Have glibc's malloc reuse freed memory rather than map fresh pages for each large
    tensor; False where it cannot be asked (not glibc).

    A prefill's activations are tens of MB each, above malloc's mmap threshold, so without
    this every one is a new mapping whose pages fault in, zeroed, on first write. The price:
    the process keeps its peak of activations resident. Allocations made before the call keep
    their own mappings (the KV pool and the weights are freed whole)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1


def one_malloc_arena() -> bool:
    """Have every thread allocate from glibc's main arena; call it before other threads
    start. False where it cannot be asked (not glibc).

    A thread's own arena grows in heaps of 64 MB at most, so a larger block (a long
    prefill's activations) is mapped afresh and page-faulted on every use whatever
    keep_freed_memory asked. The executor service runs its steps on a worker thread, which
    would otherwise allocate from an arena of its own."""
    libc = _libc()
    return libc is not None and hasattr(libc, "mallopt") and libc.mallopt(_M_ARENA_MAX, 1) == 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if hasattr(libc, "mallopt"):
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc
