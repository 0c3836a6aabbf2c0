#!/usr/bin/env python3
"""CPU prompt attention (pagedserve_kernels.ops.paged_attention_prefill) by chunk and cached
prefix: the kernel on the widest vectors the CPU has, the kernel held to 8-float vectors, and
torch's scaled_dot_product_attention over the same K/V laid out contiguously.

A chunk of new tokens after a cached prefix is one step of chunked prefill; SmolLM2-135M's
shape (9 heads, 3 kv heads, head size 64, blocks of 16), fp32, one layer. GFLOP/s counts the
multiply-adds of q.k and p.v over the positions each row sees.

    python bench/prefill_attention.py --json bench/results/prefill_attention_cpu.json
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

from bench.common import median_ms, print_table, write_json
from pagedserve_kernels.ops import cpu_extension

# (new tokens, cached tokens before them)
CASES = ((128, 0), (2048, 0), (512, 1536), (512, 3584), (2048, 4096), (16, 4080))
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(slots=True)
class Result:
    chunk: int
    cached: int
    kernel_ms: float
    kernel_8_float_ms: float
    sdpa_ms: float
    kernel_gflops: float
    kernel_8_float_gflops: float
    sdpa_gflops: float


def _flops(chunk: int, cached: int) -> float:
    """2 flops a multiply-add, q.k and p.v, over the (row, position) pairs a causal chunk sees."""
    pairs = chunk * cached + chunk * (chunk + 1) / 2
    return 4.0 * NUM_HEADS * HEAD_DIM * pairs


def _calls(chunk: int, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(chunk * 7919 + cached)
    context = cached + chunk
    blocks = -(-context // BLOCK_SIZE)
    keys, values = (
        torch.randn(NUM_KV_HEADS, blocks * BLOCK_SIZE, HEAD_DIM, generator=gen) for _ in "kv"
    )
    query = torch.randn(chunk, NUM_HEADS, HEAD_DIM, generator=gen)
    # The sequence owns shuffled physical blocks: copy its K/V there.
    table = torch.randperm(blocks, generator=gen)
    key_cache, value_cache = (torch.empty(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in "kv")
    for cache, data in ((key_cache, keys), (value_cache, values)):
        cache[table] = data.view(NUM_KV_HEADS, blocks, BLOCK_SIZE, HEAD_DIM).permute(1, 2, 0, 3)
    tables = table.to(torch.int32).view(1, -1)
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    context_lens = torch.tensor([context], dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    ext = cpu_extension()

    def kernel(vector_floats: int) -> Callable[[], torch.Tensor]:
        return lambda: ext.paged_attention(
            query, key_cache, value_cache, tables, context_lens, starts, scale, 0, vector_floats
        )

    group = NUM_HEADS // NUM_KV_HEADS
    q = query.view(chunk, NUM_KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3)
    k, v = (t[:, None, :context] for t in (keys, values))
    rows = torch.arange(cached, context)[:, None]
    mask = torch.arange(context)[None, :] <= rows  # each row sees its position and before

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    want = sdpa().permute(2, 0, 1, 3).reshape(chunk, NUM_HEADS, HEAD_DIM)
    for vector_floats in (0, 8):  # all three compute the same attention
        torch.testing.assert_close(kernel(vector_floats)(), want, atol=1e-4, rtol=1e-3)
    return {"kernel": kernel(0), "kernel_8_float": kernel(8), "sdpa": sdpa}


def measure(chunk: int, cached: int, min_run_time: float) -> Result:
    times = {name: median_ms(fn, min_run_time) for name, fn in _calls(chunk, cached).items()}
    gflops = {name: _flops(chunk, cached) / ms / 1e6 for name, ms in times.items()}
    return Result(
        chunk,
        cached,
        *(round(times[n], 3) for n in ("kernel", "kernel_8_float", "sdpa")),
        *(round(gflops[n], 1) for n in ("kernel", "kernel_8_float", "sdpa")),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="CHUNK@CACHED",
        help="new tokens @ cached tokens, default " + " ".join(f"{c}@{p}" for c, p in CASES),
    )
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    cases = [tuple(map(int, c.split("@"))) for c in args.cases] if args.cases else list(CASES)
    results = [
        measure(chunk, cached, args.min_run_time)
        for chunk, cached in tqdm(cases, desc="prefill attention", unit="case", file=sys.stderr)
    ]
    print_table(
        ["chunk", "cached", "kernel ms", "8-float ms", "SDPA ms", "GF/s", "8-float GF/s", "SDPA"],
        [[getattr(r, f) for f in Result.__slots__] for r in results],
        title=f"prompt attention, ms a layer, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}",
    )
    if args.json:
        config = {
            "cases": [list(c) for c in cases],
            "min_run_time": args.min_run_time,
            "shape": {
                "num_heads": NUM_HEADS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
            },
        }
        write_json(args.json, config, {"results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
