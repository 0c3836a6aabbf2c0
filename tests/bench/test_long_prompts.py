"""The long-prompt benchmark: streams keep decoding while long prompts arrive, through a
real `pagedserve serve` with and without chunked prefill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.long_prompts import summarize

ROOT = Path(__file__).resolve().parents[2]


def test_summary_keeps_only_the_window() -> None:
    streams = [[(0.0, 1), (1.0, 1), (1.5, 1), (2.0, 1), (9.0, 1)], [(1.2, 1), (1.4, 1), (2.4, 1)]]
    s = summarize(streams, ttfts=[0.5], window=(1.0, 3.0))
    assert s["itl_ms"]["max"] == 1000.0  # 1.4 -> 2.4; 0.0 and 9.0 are outside
    assert s["itl_ms"]["p50"] == pytest.approx(500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((500.0 + 600.0) / 2)
    assert s["stream_tokens"] == 8 and s["long_prompt_ttft_s"] == [0.5]


def test_events_of_several_tokens_count_every_token_in_the_time_per_token() -> None:
    """Gaps are between events (vLLM's inter-token latency); time per token between tokens."""
    streams = [[(1.0, 1), (1.2, 3), (2.0, 4)]]
    s = summarize(streams, ttfts=[0.5], window=(0.0, 3.0))
    assert s["itl_ms"]["max"] == pytest.approx(800.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(1000.0 / 7, abs=0.05)  # rounded to 0.1 ms
    assert s["stream_events"] == 3 and s["stream_tokens"] == 8


def test_long_prompts_end_to_end(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    out = tmp_path / "long.json"
    cmd = [sys.executable, str(ROOT / "bench/long_prompts.py"), f"--model={tiny_chat_model_dir}"]
    cmd += ["--settings=off,32", "--long-lens=200,300", "--streams=2", "--stream-prompt=8"]
    cmd += ["--lead=0.5", "--gap=0.2", "--max-model-len=1024", "--num-gpu-blocks=256"]
    # The toy model's calls are faster than a server's commit interval, which would hand
    # the streams several tokens at once: each call's tokens as it comes back instead.
    cmd.append("--commit-interval=0")
    cmd.append(f"--json={out}")
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on, 32 tokens/step" in done.stdout
    settings = json.loads(out.read_text())["settings"]
    assert list(settings) == ["off", "32"]
    for s in settings.values():
        assert len(s["long_prompt_ttft_s"]) == 2 and min(s["long_prompt_ttft_s"]) > 0
        # A client starved of CPU reads several events at once: gaps of 0 are real then.
        assert s["stream_tokens"] >= s["stream_events"] > 0
        assert 0 <= s["itl_ms"]["p50"] <= s["itl_ms"]["max"]
        assert s["itl_ms"]["max"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
