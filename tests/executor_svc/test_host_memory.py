"""Host memory: the KV pool and the packed weights on huge pages; freed memory reused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from executor_svc import host_memory
from executor_svc.cache_engine import CacheEngine, CacheShape

ROOT = Path(__file__).resolve().parents[2]
needs_thp = pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="needs Linux with transparent huge pages",
)


@needs_thp
def test_a_host_kv_pool_is_advised_for_huge_pages():
    # 16 MiB per layer tensor: large enough to hold whole 2 MiB pages.
    shape = CacheShape(
        num_layers=1, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32
    )
    engine = CacheEngine(shape, num_gpu_blocks=1024, num_cpu_blocks=0, device=torch.device("cpu"))
    key, value = engine.gpu_cache[0]
    assert not key.any() and not value.any()
    for tensor in (key, value):
        assert "hg" in _vm_flags(tensor.data_ptr() + tensor.nbytes // 2)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 1000)  # 4 MB: holds a whole 2 MiB page
        self.head = nn.Linear(1000, 1000, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Linear(7, 3)  # odd sizes: the next parameter must stay aligned
        self.fp16 = nn.Linear(8, 8).to(torch.float16)


def test_packed_parameters_keep_values_ties_and_alignment():
    torch.manual_seed(0)
    module = Tied()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    x = torch.randn(2, 7)
    expected = module.norm(x)
    host_memory.pack_parameters(module)
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.data_ptr() % 64 == 0, name
        assert isinstance(p, nn.Parameter)
    assert module.head.weight is module.embed.weight
    assert module.head.weight.data_ptr() == module.embed.weight.data_ptr()  # packed once
    float32 = [p for p in module.parameters() if p.dtype == torch.float32]
    assert len({p.untyped_storage().data_ptr() for p in float32}) == 1  # one buffer per dtype
    fp16 = module.fp16.weight.untyped_storage().data_ptr()
    assert fp16 != float32[0].untyped_storage().data_ptr()
    assert torch.equal(module.norm(x), expected)


@needs_thp
def test_packed_parameters_are_advised_for_huge_pages():
    module = Tied()
    host_memory.pack_parameters(module)
    weight = module.embed.weight
    assert "hg" in _vm_flags(weight.data_ptr() + weight.nbytes // 2)


FAULTS = """
import resource, torch

def faults():  # page faults over ten 64 MB tensors, each filled and freed
    torch.empty(16 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(16 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""


def _run(script: str) -> list[str]:
    """In a process of its own: the malloc setting is process-wide and cannot be undone."""
    return subprocess.run(
        [sys.executable, "-c", FAULTS + script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_reused_without_page_faults():
    out = _run(
        "from executor_svc import host_memory\n"
        "print(faults(), host_memory.keep_freed_memory(), faults(), faults())"
    )
    mapped_afresh, kept, reused = int(out[0]), out[1], int(out[3])
    assert kept == "True"
    assert mapped_afresh >= 10 * 16  # above malloc's mmap threshold: new pages every time
    # The round right after the call grows the heap (small allocations split freed chunks
    # at first); once it holds enough free chunks, none fault.
    assert reused * 10 < mapped_afresh


THREAD_ROUNDS = (
    "import threading\n"
    "rounds = []\n"
    "thread = threading.Thread(target=lambda: rounds.extend((faults(), faults(), faults())))\n"
    "thread.start()\n"
    "thread.join()\n"
    "print(*rounds)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_worker_thread_reuses_freed_memory_only_in_the_main_arena():
    """The executor service steps on a worker thread, whose own arena maps 64 MB blocks
    afresh each time; one arena for every thread lets it reuse them like the main thread."""
    own_arena = _run(
        "from executor_svc import host_memory\nhost_memory.keep_freed_memory()\n" + THREAD_ROUNDS
    )
    one_arena = _run(
        "from executor_svc import host_memory\n"
        "assert host_memory.one_malloc_arena()\n"
        "host_memory.keep_freed_memory()\n" + THREAD_ROUNDS
    )
    assert int(own_arena[2]) >= 10 * 16  # new pages every round
    assert int(one_arena[2]) * 10 < int(own_arena[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_executor_reuses_freed_memory(tiny_model_dir: Path):
    out = _run(
        "from executor_svc.executor import Executor\n"
        "from pagedserve.settings import ExecutorConfig\n"
        "before = faults()\n"
        f"config = ExecutorConfig(model={str(tiny_model_dir)!r}, device='cpu', "
        "num_gpu_blocks=64, swap_space=0.01)\n"
        "Executor(config).init_cache()\n"
        "faults()\n"
        "print(before, faults())"
    )
    mapped_afresh, reused = int(out[0]), int(out[1])
    assert reused * 10 < mapped_afresh


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
