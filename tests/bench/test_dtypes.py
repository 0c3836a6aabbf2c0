"""bench/dtypes.py: each dtype timed on the same trace, and the bf16 agreement counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dtypes_benchmark_times_each_dtype_and_counts_agreement(tmp_path: Path) -> None:
    out = tmp_path / "dtypes.json"
    args = ["--num-requests", "2", "--rounds", "2", "--prompts", "2", "--agreement-tokens", "3"]
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dtypes.py"), *args, "--json", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    for run in result["dtypes"].values():
        assert len(run["wall_s_rounds"]) == 2 and run["output_tokens_per_s"] > 0
    assert set(result["dtypes"]) == {"float32", "bfloat16"}
    agreement = result["agreement_bf16_vs_hf_bf16"]
    assert agreement["prompts"] == 2
    for pair in ("ours_bf16_vs_hf_bf16", "hf_fp32_vs_hf_bf16"):
        assert 0 <= agreement[pair]["identical_prompts"] <= 2
        assert 0 <= agreement[pair]["token_fraction"] <= 1
