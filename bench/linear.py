#!/usr/bin/env python3
"""The C++ linear kernel (pagedserve_kernels.layer_ops on CPU, fp32, packed weights) against torch's
sgemm on the same products, by row count; --weight-dtype bfloat16 or float16 packs the kernel's
weights in 16 bits (sgemm gets them rounded, in fp32).

The rows are a decode step's sequences or a prefill's tokens; the shapes are SmolLM2-135M's
four projections of a layer, 30 layers of distinct weights on huge pages timed together as a
step reads them (540 MB with the lm_head: out of cache, as in the model), and its lm_head.

    python bench/linear.py --json bench/results/linear_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: the repository root on the path, for `bench` and `tests`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.common import median_ms, print_table, write_json
from executor_svc import host_memory
from pagedserve_kernels import layer_ops

ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# (in_features, out_features) of SmolLM2-135M: q/k/v and gate/up fused as the model runs them.
LAYER = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = {"lm_head": (576, 49152)}
NUM_LAYERS = 30


@dataclass(slots=True)
class Result:
    shapes: str  # "layer" (the four projections) or "lm_head"
    rows: int
    kernel_ms: float
    sgemm_ms: float
    sgemm_over_kernel: float  # < 1: sgemm is faster
    kernel_gflops: float
    sgemm_gflops: float


def _on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy advised for huge pages before its first touch, as the model's weights are."""
    return host_memory.zeros(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def _measure(
    name: str,
    shapes: dict[str, tuple[int, int]],
    layers: int,
    rows: int,
    min_run_time: float,
    weight_dtype: torch.dtype = torch.float32,
) -> Result:
    gen = torch.Generator().manual_seed(rows)
    plain, packed, widths = [], [], []
    for _ in range(layers):
        for k, n in shapes.values():
            w = (torch.randn(n, k, generator=gen) * k**-0.5).to(weight_dtype).float()
            plain.append(_on_huge_pages(w))
            packed.append(_on_huge_pages(layer_ops.pack_linear_weight(w, weight_dtype)))
            widths.append(n)
    inputs = [torch.randn(rows, k, generator=gen) for k, _ in shapes.values()] * layers
    products = list(zip(inputs, plain, packed, widths, strict=True))
    for x, w, p, n in products[: len(shapes)]:  # both compute the same product
        got = layer_ops.linear(x, p, None, n)
        torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)

    def run_kernel() -> None:
        for x, _, p, n in products:
            layer_ops.linear(x, p, None, n)

    def run_sgemm() -> None:
        for x, w, _, _ in products:
            F.linear(x, w)

    kernel_ms = median_ms(run_kernel, min_run_time) / layers
    sgemm_ms = median_ms(run_sgemm, min_run_time) / layers
    flops = sum(2 * rows * k * n for k, n in shapes.values())
    return Result(
        name,
        rows,
        round(kernel_ms, 4),
        round(sgemm_ms, 4),
        round(sgemm_ms / kernel_ms, 3),
        round(flops / kernel_ms / 1e6, 1),
        round(flops / sgemm_ms / 1e6, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", help=f"default {ROWS}")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    parser.add_argument(
        "--layers", type=int, default=NUM_LAYERS, help="layers' weights cycled through"
    )
    parser.add_argument(
        "--weight-dtype", default="float32", choices=("float32", "bfloat16", "float16")
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    weight_dtype = getattr(torch, args.weight_dtype)
    grid = [
        (name, shapes, layers, rows)
        for name, shapes, layers in (("layer", LAYER, args.layers), ("lm_head", LM_HEAD, 1))
        for rows in args.rows or ROWS
    ]
    results = [
        _measure(name, shapes, layers, rows, args.min_run_time, weight_dtype)
        for name, shapes, layers, rows in tqdm(grid, desc="linear", unit="shape", file=sys.stderr)
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
        ],
        [[getattr(r, f) for f in Result.__slots__] for r in results],
        title=f"linear, {args.weight_dtype} weights, {torch.get_num_threads()} threads, "
        f"CPU capability {capability}, ms per layer ({args.layers} layers' weights, out of cache)",
    )
    if args.json:
        config = {
            "rows": args.rows or list(ROWS),
            "min_run_time": args.min_run_time,
            "layers": args.layers,
            "weight_dtype": args.weight_dtype,
        }
        write_json(args.json, config, {"results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
