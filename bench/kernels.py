#!/usr/bin/env python3
"""Paged decode attention (pagedserve_kernels.ops) against contiguous attention on the same data.

For each (batch, context) the same K/V are laid out twice: scattered over a shuffled block pool
read through block tables, and contiguously as [batch, num_kv_heads, context, head_dim] for
torch's scaled_dot_product_attention. The ratio paged / contiguous is the cost of paging; the
default grid is batch 1-256 x context 128-4096 on either device (issue 3 asks < 1.5 on CPU).

    python bench/kernels.py --json bench/results/kernels_cpu.json
    python bench/kernels.py --device cuda --batch 1 32 256 --context 512 4096
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.common import median_ms, write_json
from pagedserve_kernels import ops

BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096)
TARGET_RATIO = 1.5  # issue 3: paging may cost at most 50% over contiguous attention
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int = 9  # SmolLM2-135M
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


@dataclass(slots=True)
class Result:
    batch: int
    context: int
    paged_ms: float
    contiguous_ms: float
    ratio: float


def _inputs(
    batch: int, context: int, shape: Shape, dtype: torch.dtype, device: str
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The paged and the contiguous attention call over one set of K/V."""
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq
    kv_shape = (batch, shape.num_kv_heads, blocks_per_seq * shape.block_size, shape.head_dim)
    keys, values = (torch.randn(kv_shape, generator=gen).to(device, dtype) for _ in range(2))
    query = torch.randn(batch, shape.num_heads, shape.head_dim, generator=gen).to(device, dtype)
    # Sequence s owns the shuffled physical blocks tables[s]; copy its K/V there.
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(device)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache, value_cache = (torch.empty(cache_shape, device=device, dtype=dtype) for _ in "kv")
    for cache, data in ((key_cache, keys), (value_cache, values)):
        blocks = data.transpose(1, 2).reshape(num_blocks, *cache_shape[1:])
        cache[tables.flatten()] = blocks
    tables = tables.to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    group = shape.num_heads // shape.num_kv_heads
    q = query.view(batch, shape.num_kv_heads, group, shape.head_dim)
    k, v = keys[:, :, :context], values[:, :, :context]

    def paged() -> torch.Tensor:
        return ops.paged_attention_decode(
            query, key_cache, value_cache, tables, context_lens, scale
        )

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    torch.testing.assert_close(  # both compute the same attention
        paged().view_as(q).float(), contiguous().float(), atol=2e-2, rtol=2e-2
    )
    return paged, contiguous


def run(
    batches: list[int],
    contexts: list[int],
    shape: Shape,
    dtype: torch.dtype,
    device: str,
    min_run_time: float,
) -> list[Result]:
    results = []
    grid = [(b, c) for b in batches for c in contexts]
    for batch, context in tqdm(grid, desc=f"decode {device}", unit="shape", file=sys.stderr):
        paged, contiguous = _inputs(batch, context, shape, dtype, device)
        paged_ms = median_ms(paged, min_run_time)
        contiguous_ms = median_ms(contiguous, min_run_time)
        ratio = round(paged_ms / contiguous_ms, 3)
        results.append(Result(batch, context, round(paged_ms, 4), round(contiguous_ms, 4), ratio))
        del paged, contiguous
    return results


def format_table(results: list[Result]) -> str:
    lines = [f"{'batch':>5} {'context':>7} {'paged ms':>10} {'contig ms':>10} {'ratio':>6}"]
    for r in results:
        lines.append(
            f"{r.batch:>5} {r.context:>7} {r.paged_ms:>10.3f} {r.contiguous_ms:>10.3f} "
            f"{r.ratio:>6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = Shape()
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--batch", type=int, nargs="+", help=f"default {BATCHES}")
    parser.add_argument("--context", type=int, nargs="+", help=f"default {CONTEXTS}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default float16 on CUDA, else 32")
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=defaults.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    on_cpu = args.device == "cpu"
    batches = args.batch or list(BATCHES)
    contexts = args.context or list(CONTEXTS)
    dtype_name = args.dtype or ("float32" if on_cpu else "float16")
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size)
    results = run(batches, contexts, shape, DTYPES[dtype_name], args.device, args.min_run_time)
    device_name = (
        torch.cuda.get_device_name() if not on_cpu else f"cpu ({torch.get_num_threads()} threads)"
    )
    worst = max(r.ratio for r in results)
    print(f"paged decode vs contiguous SDPA on {device_name}, {dtype_name}, {shape}")
    print(format_table(results))
    print(f"worst paged / contiguous: {worst:.2f} (target < {TARGET_RATIO})")
    if args.json:
        config = {
            "device": device_name,
            "dtype": dtype_name,
            "shape": asdict(shape),
            "batches": batches,
            "contexts": contexts,
            "min_run_time": args.min_run_time,
        }
        body = {
            "target_ratio": TARGET_RATIO,
            "worst_ratio": worst,
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, config, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
