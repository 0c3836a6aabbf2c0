"""bench/linear.py: the packed kernel and torch's sgemm timed on the same products."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_linear_benchmark_writes_both_timings(tmp_path: Path) -> None:
    out = tmp_path / "linear.json"
    rows = [1, 48]
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "linear.py"),
            "--rows",
            *map(str, rows),
            "--min-run-time",
            "0.01",
            "--layers",
            "2",
            "--json",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["config"]["layers"] == 2
    assert [(r["shapes"], r["rows"]) for r in result["results"]] == [
        ("layer", 1),
        ("layer", rows[1]),
        ("lm_head", 1),
        ("lm_head", rows[1]),
    ]
    for r in result["results"]:
        assert r["kernel_ms"] > 0 and r["sgemm_ms"] > 0
        assert r["sgemm_over_kernel"] == pytest.approx(
            r["sgemm_ms"] / r["kernel_ms"],
            rel=0.01,
            abs=1e-3,  # the ratio is printed to 3 decimals
        )
        assert r["kernel_gflops"] > 0 and r["sgemm_gflops"] > 0
