"""Benchmark results carry no machine paths: they are committed to the repository."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import ROOT, write_json


def test_paths_in_a_result_are_portable(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    config = {
        "script": ROOT / "bench" / "workload.py",
        "json": ROOT / "bench" / "results" / "x.json",
        "vllm_python": "/opt/some-venv/bin/python",
        "beside_checkout": ROOT.parent / "elsewhere" / "bin" / "python",
        "short": Path("/tmp/details"),
        "preset": "sharegpt",
        "num_requests": 3,
    }
    write_json(out, config, {"systems": {}})
    written = json.loads(out.read_text())["config"]
    assert written == {
        "script": "bench/workload.py",
        "json": "bench/results/x.json",
        "vllm_python": ".../some-venv/bin/python",
        "beside_checkout": ".../elsewhere/bin/python",  # not ../elsewhere: outside the repo
        "short": ".../tmp/details",  # fewer than three parts below the root: not "/tmp/..."
        "preset": "sharegpt",
        "num_requests": 3,
    }
