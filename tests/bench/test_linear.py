"""bench/linear.py: the kernel and sgemm timed on the same products, and the path layer_ops
would take at each row count reported as it decides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import layer_ops

ROOT = Path(__file__).resolve().parents[2]


def test_linear_benchmark_writes_both_timings(tmp_path: Path) -> None:
    out = tmp_path / "linear.json"
    rows = [1, layer_ops.SGEMM_MIN_ROWS]
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "linear.py"),
            "--rows",
            *map(str, rows),
            "--min-run-time",
            "0.01",
            "--json",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["sgemm_min_rows"] == layer_ops.SGEMM_MIN_ROWS
    assert result["wide_sgemm"] == layer_ops.WIDE_SGEMM
    assert [(r["shapes"], r["rows"]) for r in result["results"]] == [
        ("layer", 1),
        ("layer", rows[1]),
        ("lm_head", 1),
        ("lm_head", rows[1]),
    ]
    for r in result["results"]:
        assert r["kernel_ms"] > 0 and r["sgemm_ms"] > 0
        assert r["sgemm_over_kernel"] == pytest.approx(r["sgemm_ms"] / r["kernel_ms"], rel=0.01)
        takes = "kernel" if layer_ops.takes_kernel(r["rows"]) else "sgemm"
        assert r["layer_ops_takes"] == takes
    # One row always stays on the kernel; at SGEMM_MIN_ROWS only AVX-512 machines use sgemm.
    assert result["results"][0]["layer_ops_takes"] == "kernel"
    expected = "sgemm" if layer_ops.WIDE_SGEMM else "kernel"
    assert result["results"][1]["layer_ops_takes"] == expected
