"""The throughput benchmark runs end to end on a toy model: pagedserve in-process and as
services, transformers' static and continuous batching; vLLM is reported as skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import load_trace
from pagedserve.settings import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, model: Path, *flags: str) -> dict:
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, str(ROOT / "bench/throughput.py"), f"--model={model}", f"--json={out}"]
    cmd += ["--num-gpu-blocks=256", "--swap-space=0.05", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vs pagedserve" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.redis
def test_throughput_pagedserve_and_services(
    tmp_path: Path, tiny_chat_model_dir: Path, redis_url: str
) -> None:
    flags = ["--preset=sharegpt", "--num-requests=6", "--max-model-len=128", "--rounds=2"]
    flags += ["--systems=pagedserve,services", f"--redis={redis_url}"]
    result = run_bench(tmp_path, tiny_chat_model_dir, *flags)
    assert result["config"]["num_requests"] == 6
    systems = result["systems"]
    assert set(systems) == {"pagedserve", "services", "hf", "hf-cb", "vllm"}
    expected = sum(load_trace("sharegpt", 6, 128, 0).output_lens)
    for name in ("pagedserve", "services"):
        s = systems[name]
        assert s["num_requests"] == 6
        assert s["output_tokens"] == expected == result["config"]["sum_max_tokens"]
        assert s["wall_s"] > 0
        assert s["total_tokens_per_s"] > s["output_tokens_per_s"] > 0
        rounds = s["wall_s_rounds"]  # the mean of two runs, in the order A B B A
        assert len(rounds) == 2 and s["wall_s"] == round(sum(rounds) / 2, 3)
        assert s["output_tokens_per_s"] == round(expected / (sum(rounds) / 2), 2)
    assert systems["pagedserve"]["prefill_tokens_computed"] == result["config"]["sum_prompt_tokens"]
    ps = systems["pagedserve"]  # the in-process engine's time inside its executor's steps
    assert 0 < ps["execute_s"] < ps["wall_s_rounds"][-1]
    split = systems["services"]["executor"]  # the last round's, read from the executor
    assert split["wall_s"] == systems["services"]["wall_s_rounds"][-1]
    longest = max(load_trace("sharegpt", 6, 128, 0).output_lens)
    assert longest > split["steps"] >= longest / SchedulerConfig.num_decode_steps
    assert 0 < split["step_s"] < split["wall_s"]
    outside = 1e3 * (split["wall_s"] - split["step_s"]) / split["steps"]  # of rounded times
    rounding = 1.0 / split["steps"] + 0.01  # ms a call: the times are rounded to 1 ms
    assert split["outside_steps_ms_per_step"] == pytest.approx(outside, abs=rounding)
    assert "vllm" in systems["vllm"]["skipped"] and "--vllm-python" in systems["vllm"]["skipped"]
    assert systems["hf"]["skipped"].startswith("not selected")
    assert result["ratios"]["pagedserve"] == 1.0
    assert result["services_over_inprocess"] == result["ratios"]["services"] > 0


def test_throughput_hf_static_and_continuous(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    """hf runs each batch size on the head of the trace, pagedserve is timed on the same
    head for the ratio, and hf-cb generates exactly the requested tokens."""
    flags = ["--preset=alpaca", "--num-requests=5", "--max-model-len=64", "--hf-requests=2"]
    flags += ["--hf-batch-sizes=1,2,4", "--systems=pagedserve,hf,hf-cb"]
    result = run_bench(tmp_path, tiny_chat_model_dir, *flags)
    systems = result["systems"]
    trace = load_trace("alpaca", 5, 64, 0)
    hf = systems["hf"]
    assert set(hf["batch_sizes"]) == {"1", "2", "4"}
    assert hf["batch_sizes"]["4"]["wall_s"] == hf["batch_sizes"]["2"]["wall_s"]  # not rerun
    assert hf["batch_sizes"]["4"]["note"] == "one batch of all 2 requests"
    for run in hf["batch_sizes"].values():
        assert run["num_requests"] == 2 and run["output_tokens"] == sum(trace.output_lens[:2])
    best = max(hf["batch_sizes"], key=lambda b: hf["batch_sizes"][b]["output_tokens_per_s"])
    assert hf["best_batch_size"] == int(best)
    assert hf["output_tokens_per_s"] == hf["batch_sizes"][best]["output_tokens_per_s"]
    head = systems["pagedserve"]["head"]
    assert head["num_requests"] == 2 and head["output_tokens"] == sum(trace.output_lens[:2])
    assert result["ratios"]["hf"] == round(
        hf["output_tokens_per_s"] / head["output_tokens_per_s"], 3
    )
    whole_trace = systems["pagedserve"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
    assert result["pagedserve_rate_over_best_hf_static"] == round(whole_trace, 3)
    assert systems["hf-cb"]["output_tokens"] == sum(trace.output_lens)
    assert systems["hf-cb"]["output_tokens_per_s"] > 0
    assert systems["services"]["skipped"].startswith("not selected")
