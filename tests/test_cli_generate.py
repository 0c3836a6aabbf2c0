"""`pagedserve generate` as a user runs it: a real process, a prompts file, JSON lines out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PAGEDSERVE = [sys.executable, "-m", "pagedserve.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    small = ["--swap-space", "0.01"] if args[0] == "generate" else []
    return subprocess.run([*PAGEDSERVE, *args, *small], capture_output=True, text=True, timeout=300)


def test_generate_json_lines_in_input_order(tiny_model_dir: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 6},
        {"prompt_token_ids": list(range(10, 60))},
        {"prompt_token_ids": [42], "max_tokens": 3},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompts-file",
        str(prompts),
        "--num-gpu-blocks",
        "64",
    ]
    done = run(*args, "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["id"] for r in results] == ["0", "1", "2"]
    assert [len(r["outputs"][0]["token_ids"]) for r in results] == [6, 4, 3]
    assert all(r["outputs"][0]["cumulative_logprob"] <= 0 for r in results)
    assert "generating" in done.stderr  # the progress bar
    again = run(
        *args,
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--block-size",
        "8",
        "--num-gpu-blocks",
        "12",
        "--preemption-mode",
        "swap",
    )
    # The same tokens; the logprobs to rounding: attention folds its softmax one KV block at a
    # time, so another block size sums in another order.
    redone = [json.loads(line) for line in again.stdout.splitlines()]
    assert [r["outputs"][0]["token_ids"] for r in redone] == [
        r["outputs"][0]["token_ids"] for r in results
    ]
    for r, first in zip(redone, results, strict=True):
        logprob = first["outputs"][0]["cumulative_logprob"]
        assert r["outputs"][0]["cumulative_logprob"] == pytest.approx(logprob, rel=1e-5)


def test_generate_n_samples_and_beams(tiny_model_dir: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [7, 8, 9, 10]}) + "\n")
    base = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--num-gpu-blocks",
        "64",
    ]
    sampled = json.loads(run(*base, "--n", "3", "--seed", "1").stdout)
    assert len(sampled["outputs"]) == 3
    beams = json.loads(run(*base, "--n", "2", "--beam-width", "3").stdout)["outputs"]
    assert len(beams) == 2 and beams[0]["cumulative_logprob"] >= beams[1]["cumulative_logprob"]


def test_generate_refuses_text_without_a_tokenizer(tiny_model_dir: Path):
    done = run("generate", "--model", str(tiny_model_dir), "--prompt", "hello")
    assert done.returncode == 2 and "has no tokenizer" in done.stderr


def test_generate_rejects_a_bad_prompts_file(tiny_model_dir: Path, tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2]}\nnot json\n')
    done = run("generate", "--model", str(tiny_model_dir), "--prompts-file", str(bad))
    assert done.returncode == 2 and "bad.jsonl:2: not JSON" in done.stderr
