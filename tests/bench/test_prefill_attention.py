"""bench/prefill_attention.py: the kernel on both vector widths and SDPA, timed on the same
attention (the script checks that all three agree before timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_attention_benchmark_times_all_three(tmp_path: Path) -> None:
    out = tmp_path / "prefill_attention.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "prefill_attention.py"),
            "--cases",
            "40@0",
            "24@100",
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
    assert [(r["chunk"], r["cached"]) for r in result["results"]] == [(40, 0), (24, 100)]
    for r in result["results"]:
        for name in ("kernel", "kernel_8_float", "sdpa"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_gflops"] > 0
