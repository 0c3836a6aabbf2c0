"""What a checkpoint's files set for the API: generation_config.json fills the sampling
fields a request leaves out, as vLLM applies it (`--generation-config vllm` keeps the
built-in defaults), and the chat template (`--chat-template FILE` replaces it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pagedserve.model_files import load_generation_defaults, load_tokenizer
from pagedserve.settings import ApiConfig
from scheduler_svc.api.admission import chat_prompt_ids, sampling_defaults
from scheduler_svc.api.errors import APIError
from scheduler_svc.api.protocol import parse_completion
from tests.services import serve

GENERATION_CONFIG = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 0,  # no limit, in transformers' spelling
    "repetition_penalty": 1.0,  # transformers' own default: no choice made
    "max_new_tokens": 5,
    "do_sample": True,
    "eos_token_id": 2,
}


def with_generation_config(path: Path, **config) -> Path:
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_the_file_is_read_by_request_field(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path) == {}
    with_generation_config(tmp_path, **GENERATION_CONFIG)
    assert load_generation_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 5,
    }


def test_defaults_fill_only_what_a_request_leaves_out() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    left_out = parse_completion({"model": "m", "prompt": "Hi"}, ApiConfig(), False, None, defaults)
    assert (left_out.params.temperature, left_out.params.top_p) == (0.6, 0.9)
    assert left_out.params.max_tokens == 5
    body = {"model": "m", "prompt": "Hi", "temperature": 0, "max_completion_tokens": 9}
    given = parse_completion(body, ApiConfig(), False, None, defaults)
    assert (given.params.temperature, given.params.top_p, given.params.max_tokens) == (0, 0.9, 9)
    beam = {"model": "m", "prompt": "Hi", "use_beam_search": True, "n": 2}
    beam = parse_completion(beam, ApiConfig(), False, None, defaults).params
    assert (beam.temperature, beam.top_p, beam.max_tokens) == (0, 1.0, 5)


def test_the_flag_picks_the_source_and_refuses_a_bad_file(tmp_path: Path) -> None:
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    with_generation_config(model, max_new_tokens=5)
    with_generation_config(other, top_p=0.5)
    assert sampling_defaults("auto", model) == {"max_tokens": 5}
    assert sampling_defaults("vllm", model) == {}
    assert sampling_defaults(str(other), model) == {"top_p": 0.5}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        sampling_defaults(str(tmp_path), model)
    with_generation_config(other, temperature=7.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(str(other), model)


@pytest.fixture(scope="module")
def configured_model(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("configured") / "model"
    shutil.copytree(tiny_chat_model_dir, path)
    return with_generation_config(path, temperature=0.0, max_new_tokens=5)


def test_a_model_without_a_chat_template_refuses_chats(tiny_chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(APIError, match="--chat-template") as refused:
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    assert (refused.value.status, refused.value.param) == (400, "messages")


TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.mark.parametrize("flag, num_tokens", [("auto", 5), ("vllm", 16)])
def test_a_served_checkpoint_answers_with_its_defaults(
    configured_model: Path, tmp_path: Path, flag: str, num_tokens: int
) -> None:
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    flags = ["--generation-config", flag, "--chat-template", str(tmp_path / "chat.jinja")]
    with serve(configured_model, "--num-gpu-blocks", "64", *flags) as url:
        body = {"model": str(configured_model), "prompt": "The harbour", "ignore_eos": True}
        answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=60) for _ in range(2)]
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        tokens = httpx.post(f"{url}/tokenize", json=chat, timeout=60).json()["tokens"]
    assert tokens == load_tokenizer(configured_model).encode("<<Hi>>", add_special_tokens=False)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == num_tokens
    if flag == "auto":  # temperature 0: greedy, the same text twice
        assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
