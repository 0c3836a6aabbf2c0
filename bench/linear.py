#!/usr/bin/env python3
"""The C++ linear kernel (kernels.layer_ops on CPU, fp32) against torch's sgemm, by row count.

The rows are a decode step's sequences or a prefill's tokens; the shapes are SmolLM2-135M's
four projections of one layer, timed together, and its lm_head. The kernel streams W once for
a few rows, where sgemm spends its time packing W; on AVX-512 machines sgemm's 16-float
registers win from some row count on, which is where layer_ops.SGEMM_MIN_ROWS comes from.

    python bench/linear.py --json bench/results/linear_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as `python bench/linear.py`: this file's directory would shadow the `kernels` package.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.common import median_ms, print_table, write_json
from kernels import layer_ops
from kernels.ops import cpu_extension

ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# (in_features, out_features) of SmolLM2-135M: q/k/v and gate/up fused as the model runs them.
LAYER = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = {"lm_head": (576, 49152)}


@dataclass(slots=True)
class Result:
    shapes: str  # "layer" (the four projections) or "lm_head"
    rows: int
    kernel_ms: float
    sgemm_ms: float
    sgemm_over_kernel: float  # < 1: sgemm is faster
    kernel_gflops: float
    sgemm_gflops: float
    layer_ops_takes: str  # the path layer_ops.linear picks for this many rows


def _measure(
    name: str, shapes: dict[str, tuple[int, int]], rows: int, min_run_time: float
) -> Result:
    gen = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, k, generator=gen) * k**-0.5 for k, n in shapes.values()]
    inputs = [torch.randn(rows, k, generator=gen) for k, _ in shapes.values()]
    kernel = cpu_extension().linear
    for x, w in zip(inputs, weights, strict=True):  # both compute the same product
        torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-4)

    def run_kernel() -> None:
        for x, w in zip(inputs, weights, strict=True):
            kernel(x, w, None)

    def run_sgemm() -> None:
        for x, w in zip(inputs, weights, strict=True):
            F.linear(x, w)

    kernel_ms = median_ms(run_kernel, min_run_time)
    sgemm_ms = median_ms(run_sgemm, min_run_time)
    flops = sum(2 * rows * k * n for k, n in shapes.values())
    takes = "kernel" if layer_ops.takes_kernel(rows) else "sgemm"
    return Result(
        name,
        rows,
        round(kernel_ms, 4),
        round(sgemm_ms, 4),
        round(sgemm_ms / kernel_ms, 3),
        round(flops / kernel_ms / 1e6, 1),
        round(flops / sgemm_ms / 1e6, 1),
        takes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", help=f"default {ROWS}")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    grid = [
        (name, shapes, rows)
        for name, shapes in (("layer", LAYER), ("lm_head", LM_HEAD))
        for rows in args.rows or ROWS
    ]
    results = [
        _measure(name, shapes, rows, args.min_run_time)
        for name, shapes, rows in tqdm(grid, desc="linear", unit="shape", file=sys.stderr)
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    print_table(
        [
            "shapes",
            "rows",
            "kernel ms",
            "sgemm ms",
            "sgemm/kernel",
            "kernel GF/s",
            "sgemm GF/s",
            "layer_ops takes",
        ],
        [[getattr(r, f) for f in Result.__slots__] for r in results],
        title=f"linear, fp32, {torch.get_num_threads()} threads, CPU capability {capability}: "
        + (f"sgemm from {layer_ops.SGEMM_MIN_ROWS} rows" if layer_ops.WIDE_SGEMM else "no sgemm"),
    )
    if args.json:
        config = {"rows": args.rows or list(ROWS), "min_run_time": args.min_run_time}
        body = {
            "cpu_capability": capability,
            "wide_sgemm": layer_ops.WIDE_SGEMM,
            "sgemm_min_rows": layer_ops.SGEMM_MIN_ROWS,
            "results": [asdict(r) for r in results],
        }
        write_json(args.json, config, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
