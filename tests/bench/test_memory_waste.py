"""The memory-waste benchmark runs end to end on a small trace and orders the systems."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_waste_writes_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "waste.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/memory_waste.py"),
        "--preset",
        "sharegpt",
        "--num-requests",
        "40",
        "--kv-slots",
        "8192",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    assert "orca_oracle" in done.stdout
    systems = json.loads(out.read_text())["systems"]
    assert set(systems) == {"paged", "orca_max", "orca_pow2", "orca_oracle"}
    util = {name: s["utilization"] for name, s in systems.items()}
    assert util["paged"] > 0.9
    assert util["paged"] > util["orca_oracle"] > util["orca_pow2"] > util["orca_max"]
    assert systems["paged"]["peak_concurrent"] > systems["orca_max"]["peak_concurrent"]
    assert out.with_suffix(".png").stat().st_size > 10_000
