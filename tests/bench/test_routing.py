"""The routing benchmark on the tiny model: two executors, two system prompts; prefix-aware
routing finds prompts in the prefix cache that round robin computes again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.redis
def test_prefix_routing_hits_where_round_robin_recomputes(tmp_path, tiny_chat_model_dir, redis_url):
    out = tmp_path / "routing.json"
    cmd = [sys.executable, str(ROOT / "bench/routing.py"), f"--json={out}"]
    cmd += [f"--model={tiny_chat_model_dir}", "--num-requests=8", "--shared-prefix-len=256"]
    cmd += ["--num-gpu-blocks=512", f"--redis={redis_url}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    systems = json.loads(out.read_text())["systems"]
    prefix, round_robin = systems["prefix"], systems["round-robin"]
    assert prefix["prefix_cache_queries"] == round_robin["prefix_cache_queries"] > 8 * 256
    assert prefix["prefix_hit_rate"] > round_robin["prefix_hit_rate"]
    assert prefix["prefill_tokens_computed"] < round_robin["prefill_tokens_computed"]
    for run in systems.values():
        assert run["output_tokens"] > 0 and run["output_tokens_per_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
