"""Architectures served by real executor and scheduler processes (HTTP, prefix caching on)
answer transformers' greedy tokens and logprobs: one of each model class and weight layout
(tests/executor_svc/test_architectures.py checks every case offline; the model code a
server runs is the same)."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.executor_svc.test_architectures import CASES, save_tiny
from tests.executor_svc.test_generation_vs_hf import hf_greedy, make_prompts
from tests.services import serve

VOCAB = 49152  # the default model's tokenizer, for the API's text
NEW_TOKENS = 24
LONG_TOKENS = 200  # the sliding-window model's outputs: many windows of 24


SERVED = ("phi3", "gemma3", "mistral-sliding-window")  # fused checkpoint weights, own class, window


def served_model(name: str, tmp_path_factory, smollm2_dir: Path) -> Path:
    """A tiny random checkpoint of case ``name`` with the default model's tokenizer."""
    config_class, overrides = CASES[name]
    model_dir = tmp_path_factory.mktemp(f"served-{name}")
    save_tiny(model_dir, config_class, overrides | {"vocab_size": VOCAB})
    for path in smollm2_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, model_dir / path.name)
    return model_dir


@pytest.fixture(scope="module", params=SERVED)
def served_case(request, tmp_path_factory, smollm2_dir: Path):
    model_dir = served_model(request.param, tmp_path_factory, smollm2_dir)
    system = make_prompts(VOCAB, [40], seed=5)[0]
    prompts = make_prompts(VOCAB, [8, 60], seed=11, prefix=system)
    return model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS)


def assert_served_as_hf(
    model_dir: Path, logprobs: dict, hf_tokens: list[int], hf_tops: list[dict]
) -> None:
    """The served tokens are transformers' greedy ones (at a near-tie of the random model,
    each in the other's top 5, then stop), each logprob equal to fp32 rounding: recomputing
    a preempted group or a prompt in chunks rounds differently from decoding step by step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(logprobs["tokens"]) == len(hf_tokens)
    steps = zip(logprobs["tokens"], logprobs["top_logprobs"], hf_tokens, hf_tops, strict=True)
    for step, (ours, our_top, theirs, their_top) in enumerate(steps):
        if ours != tokenizer.decode([theirs]):
            assert ours in {tokenizer.decode([t]) for t in their_top}, f"step {step}"
            assert tokenizer.decode([theirs]) in our_top, f"step {step}"
            return
        assert logprobs["token_logprobs"][step] == pytest.approx(their_top[theirs], abs=2e-4), (
            f"step {step}: logprob of {ours!r}"
        )


def test_served_greedy_matches_hf(served_case) -> None:
    model_dir, prompts, reference = served_case
    with serve(model_dir, "--block-size", "8") as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for prompt, (hf_tokens, hf_tops) in zip(prompts, reference, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS}
            body |= {"temperature": 0, "logprobs": 5, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            logprobs = response.json()["choices"][0]["logprobs"]
            assert_served_as_hf(model_dir, logprobs, hf_tokens, hf_tops)


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_served_sliding_window_frees_blocks_and_matches_hf_under_preemption(
    tmp_path_factory, smollm2_dir: Path, scheduling: str
) -> None:
    """Prompts and outputs of many windows sent together to a pool that holds a few: blocks
    outside the window go back to it, groups are preempted and recomputed (one call at a
    time: a call sent ahead never preempts, and here the calls that did not go ahead
    found room), and every answer still equals transformers'."""
    model_dir = served_model("mistral-sliding-window", tmp_path_factory, smollm2_dir)
    system = make_prompts(VOCAB, [48], seed=8)[0]
    prompts = make_prompts(VOCAB, [150, 280], seed=5, prefix=system) + make_prompts(VOCAB, [230])
    reference = hf_greedy(model_dir, prompts, LONG_TOKENS)
    flags = ("--block-size", "8", "--num-gpu-blocks", "15", "--max-num-batched-tokens", "32")
    with serve(model_dir, *flags, "--preemption-mode", "recompute", scheduling) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        def complete(prompt: list[int]) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": LONG_TOKENS}
            body |= {"temperature": 0, "logprobs": 5, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["logprobs"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        metrics = httpx.get(f"{url}/metrics").text
    assert _counter(metrics, "pagedserve_kv_blocks_freed_outside_window_total") > 0
    if scheduling == "--no-async-scheduling":
        assert _counter(metrics, 'pagedserve_preemptions_total{mode="recompute"}') > 0
    for logprobs, (hf_tokens, hf_tops) in zip(answers, reference, strict=True):
        assert_served_as_hf(model_dir, logprobs, hf_tokens, hf_tops)


def _counter(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])
