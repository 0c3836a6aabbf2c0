"""Architectures served by real executor and scheduler processes (HTTP, prefix caching on)
answer transformers' greedy tokens and logprobs: one of each model class and weight layout
(tests/executor_svc/test_architectures.py checks every case offline; the model code a
server runs is the same)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.executor_svc.test_architectures import CASES, save_tiny
from tests.executor_svc.test_generation_vs_hf import hf_greedy, make_prompts
from tests.services import serve

VOCAB = 49152  # the default model's tokenizer, for the API's text
NEW_TOKENS = 24


SERVED = ("phi3", "gemma3", "mistral-sliding-window")  # fused checkpoint weights, own class, window


@pytest.fixture(scope="module", params=SERVED)
def served_case(request, tmp_path_factory, smollm2_dir: Path):
    config_class, overrides = CASES[request.param]
    model_dir = tmp_path_factory.mktemp(f"served-{request.param}")
    save_tiny(model_dir, config_class, overrides | {"vocab_size": VOCAB})
    for name in smollm2_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, model_dir / name.name)
    system = make_prompts(VOCAB, [40], seed=5)[0]
    prompts = make_prompts(VOCAB, [8, 60], seed=11, prefix=system)
    return model_dir, prompts, hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_served_greedy_matches_hf(served_case) -> None:
    from transformers import AutoTokenizer

    model_dir, prompts, reference = served_case
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with serve(model_dir, "--block-size", "8") as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for prompt, (hf_tokens, hf_tops) in zip(prompts, reference, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS}
            body |= {"temperature": 0, "logprobs": 1, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            logprobs = response.json()["choices"][0]["logprobs"]
            assert logprobs["tokens"] == [tokenizer.decode([t]) for t in hf_tokens]
            expected = [tops[t] for t, tops in zip(hf_tokens, hf_tops, strict=True)]
            assert logprobs["token_logprobs"] == pytest.approx(expected, abs=2e-4)
