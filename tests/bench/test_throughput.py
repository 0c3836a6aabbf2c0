"""The throughput benchmark runs end to end on a toy model, in-process and as services."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sum_max_tokens(num_requests: int, max_model_len: int) -> int:
    """The trace's output budget, recomputed through memory_waste's loader."""
    spec = importlib.util.spec_from_file_location("memory_waste", ROOT / "bench/memory_waste.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
        trace = module.load_trace(module.WORKLOAD, "sharegpt", num_requests, max_model_len, 0)
    finally:
        del sys.modules[spec.name]
    return sum(trace.output_lens)


def test_throughput_pagedserve_and_services(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    out = tmp_path / "throughput.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/throughput.py"),
        "--preset=sharegpt",
        "--num-requests=6",
        "--max-model-len=128",
        "--num-gpu-blocks=256",
        "--swap-space=0.05",
        f"--model={tiny_chat_model_dir}",
        "--systems=pagedserve,services",
        f"--json={out}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "services" in done.stdout and "vs pagedserve" in done.stdout
    result = json.loads(out.read_text())
    assert result["config"]["num_requests"] == 6
    systems = result["systems"]
    assert set(systems) == {"pagedserve", "services", "hf", "vllm"}
    expected = sum_max_tokens(6, 128)
    for name in ("pagedserve", "services"):
        s = systems[name]
        assert s["num_requests"] == 6
        assert s["output_tokens"] == expected == result["config"]["sum_max_tokens"]
        assert s["wall_s"] > 0
        assert s["total_tokens_per_s"] > s["output_tokens_per_s"] > 0
    assert "vllm" in systems["vllm"]["skipped"] and "--vllm-python" in systems["vllm"]["skipped"]
    assert systems["hf"]["skipped"]
    assert result["services_over_inprocess"] > 0
