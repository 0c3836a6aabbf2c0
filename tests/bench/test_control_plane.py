"""The control-plane benchmark: a stand-in executor that sleeps through its forward pass,
behind the real scheduler with Redis journaling, with both modes of calling it."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.control_plane import Counters, Load, Sample, figures, parse_args
from bench.standin_executor import standin_token
from pagedserve.settings import SERVING_COMMIT_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]


def test_figures_of_a_window() -> None:
    a = Sample(
        at=10.0,
        busy_s=1.0,
        own_s=0.1,
        calls=100,
        scheduler=Counters(tokens=800.0, running=4, ended=10, ttft_sum_s=1.0, ttft_count=10),
        scheduler_cpu_s=2.0,
        executor_cpu_s=1.0,
        client_cpu_s=0.5,
    )
    b = Sample(
        at=12.0,
        busy_s=2.6,
        own_s=0.2,
        calls=300,
        scheduler=Counters(tokens=2400.0, running=4, ended=30, ttft_sum_s=4.0, ttft_count=30),
        scheduler_cpu_s=2.5,
        executor_cpu_s=1.4,
        client_cpu_s=0.6,
    )
    f = figures(a, b, num_seqs=8, step_ms=5.0)
    assert f["busy_fraction"] == 0.8 and f["calls"] == 200 and f["decode_steps"] == 200
    assert (
        f["forward_fraction"] == 0.5
        and f["decode_steps_per_s"] == 100
        and f["gap_ms_per_call"] == pytest.approx(2.0)
    )
    # of the 0.4 s outside steps, 0.1 s the executor's own work, the rest waiting
    assert f["executor_own_ms_per_call"] == pytest.approx(0.5)
    assert f["late_ms_per_call"] == pytest.approx(1.5)
    assert f["scheduler_cpu_ms_per_call"] == 2.5 and f["scheduler_cpu_cores"] == 0.25
    assert f["scheduler_bound"] == 1.0  # 1.6 s inside steps for 0.5 s of scheduler CPU
    slow = figures(a, dataclasses.replace(b, scheduler_cpu_s=5.2), num_seqs=8, step_ms=5.0)
    assert slow["scheduler_bound"] == 0.5
    assert f["client_cpu_cores"] == pytest.approx(0.05)
    assert f["executor_cpu_ms_per_call"] == pytest.approx(2.0)
    assert f["arrivals_per_s"] == 10 and f["ttft_mean_ms"] == 150  # 3 s over 20 first tokens


def test_prompts_share_the_prefix_asked_for_and_differ_after_it() -> None:
    for shared in (0, 48):
        load = Load(
            "http://unused", "m", parse_args(["--prompt-len=64", f"--shared-prefix={shared}"])
        )
        a, b = load.prompt(), load.prompt()
        assert len(a) == len(b) == 64
        assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
        assert a[shared] != b[shared]  # not a token longer
    with pytest.raises(SystemExit):
        parse_args(["--prompt-len=64", "--shared-prefix=65"])


def test_standin_tokens_depend_on_sequence_and_position_only() -> None:
    assert standin_token(3, 70) == standin_token(3, 70)
    assert len({standin_token(3, p) for p in range(100)}) == 100
    assert standin_token(3, 70) != standin_token(4, 70)


def test_control_plane_end_to_end(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    out = tmp_path / "cp.json"
    cmd = [sys.executable, str(ROOT / "bench/control_plane.py"), f"--model={tiny_chat_model_dir}"]
    cmd += ["--step-ms=5", "--seqs=2,6", "--decode-steps=1,4", "--warmup=0.3", "--window=1"]
    cmd += ["--prompt-len=16", "--max-tokens=256", "--max-model-len=1024"]
    cmd += ["--num-gpu-blocks=1024", f"--json={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 steps in a row" in done.stdout and "sched CPU ms/call" in done.stdout
    result = json.loads(out.read_text())
    assert result["machine"]["cpu"] and result["targets"]["one_step"] == 0.9
    runs = result["runs"]
    assert [(r["num_decode_steps"], r["scheduling"], r["num_seqs"]) for r in runs] == [
        (k, scheduling, n) for k in (1, 4) for scheduling in ("async", "sync") for n in (2, 6)
    ]
    for r in runs:
        # The executor counts a call's time inside steps when the call ends: a window may
        # be off by one call's steps at either end.
        slack_s = 2 * r["num_decode_steps"] * r["step_ms"] / 1000
        assert r["calls"] > 0 and r["decode_steps"] > 0
        assert 0 < r["busy_fraction"] <= 1 + slack_s / r["window_s"]
        assert 0 < r["forward_fraction"] <= r["busy_fraction"] + 0.05
        assert r["scheduler_cpu_ms_per_call"] > 0
        slack_ms_per_call = 1000 * slack_s / r["calls"]
        assert r["gap_ms_per_call"] >= -slack_ms_per_call
        # the executor's own work between passes is part of the gap, and takes time
        assert 0 < r["executor_own_ms_per_call"] <= r["gap_ms_per_call"] + slack_ms_per_call
        assert r["executor_cpu_ms_per_call"] > 0
        assert r["running_at_end"] <= r["num_seqs"]
        if r["num_decode_steps"] == 1:  # a call computes one token per sequence at most
            # The scheduler counts tokens as their events are made: calls that share a
            # commit are counted with it, so either end of a window may count the calls of
            # one commit interval, and one call in flight, more.
            shared = math.ceil(SERVING_COMMIT_INTERVAL_S * 1000 / r["step_ms"])
            assert r["decode_steps"] <= r["calls"] + 2 * (shared + 1)
            # and sent ahead, about one: the sequences follow from call to call
            assert r["scheduling"] == "sync" or r["decode_steps"] > 0.8 * r["calls"]
        else:
            assert r["decode_steps"] > 1.5 * r["calls"]
    assert out.with_suffix(".png").stat().st_size > 10_000
