"""The sliding-window benchmark end to end: the same trace on the same pool with blocks
outside the window returned and kept, through the real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sliding_window_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "sliding.json"
    cmd = [sys.executable, str(ROOT / "bench/sliding_window.py"), "--num-requests=3"]
    cmd += ["--prompt-lens=300-400", "--output-lens=60-80", "--window=32", "--block-size=8"]
    cmd += ["--num-gpu-blocks=160", "--max-model-len=1024", "--max-num-batched-tokens=64"]
    cmd.append(f"--json={out}")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    settings = json.loads(out.read_text())["settings"]
    freed, kept = settings["freed"], settings["kept"]
    assert (freed["sliding_window"], kept["sliding_window"]) == (32, 0)
    assert freed["output_tokens"] == kept["output_tokens"] > 0
    assert freed["blocks_freed_outside_window"] > 0 == kept["blocks_freed_outside_window"]
    # a window of 32 and chunks of 64 hold at most blocks_for(95) + 1 = 13 blocks a sequence
    assert freed["peak_blocks_used"] <= 3 * 13 < kept["peak_blocks_used"]
    assert out.with_suffix(".png").stat().st_size > 10_000
