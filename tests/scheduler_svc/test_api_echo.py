"""`echo` and prompt logprobs over a real `pagedserve serve`: the prompt's text and tokens
come back before the completion, scored as a transformers forward pass scores them, also
with nothing generated (what log-likelihood harnesses send) and streamed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from openai import OpenAI

from pagedserve.model_files import load_tokenizer
from tests.executor_svc.test_generation_vs_hf import hf_greedy
from tests.executor_svc.test_prompt_logprobs_vs_hf import TOLERANCE, hf_prompt_logprobs
from tests.services import GUARD_KEY

PROMPT = "The harbour committee met on a grey morning to weigh the plans"
GUARD = {"Authorization": f"Bearer {GUARD_KEY}"}


def complete(server: SimpleNamespace, **body: object) -> dict:
    r = server.client.post(
        "/v1/completions", json={"model": server.model, "prompt": PROMPT} | body, headers=GUARD
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def prompt_ids(tiny_chat_model_dir: Path) -> list[int]:
    return load_tokenizer(tiny_chat_model_dir).encode(PROMPT)


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(
    guarded_server: SimpleNamespace, tiny_chat_model_dir: Path, prompt_ids: list[int]
) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt back, scored, nothing drawn."""
    body = complete(guarded_server, echo=True, logprobs=2, max_tokens=0, temperature=0)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 0,
        "total_tokens": len(prompt_ids),
    }
    logprobs = choice["logprobs"]
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = hf_prompt_logprobs(tiny_chat_model_dir, prompt_ids)
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        [p.logprob for p in reference], abs=TOLERANCE
    )
    for top, ref in zip(logprobs["top_logprobs"][1:], reference, strict=True):
        expected = {tokenizer.decode([t]): v for t, v in list(ref.top_logprobs.items())[:2]}
        assert top == pytest.approx(expected, abs=TOLERANCE)
    tokens = logprobs["tokens"]
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    as_ids = complete(guarded_server, prompt=prompt_ids, echo=True, logprobs=2, max_tokens=0)
    assert as_ids["choices"][0]["text"] == tokenizer.decode(prompt_ids)
    again = as_ids["choices"][0]["logprobs"]
    assert (again["tokens"], again["text_offset"]) == (tokens, logprobs["text_offset"])
    assert again["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=TOLERANCE)


def test_echo_puts_the_prompt_before_the_same_completion(guarded_server: SimpleNamespace) -> None:
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    plain = complete(guarded_server, **greedy)["choices"][0]
    echoed = complete(guarded_server, echo=True, **greedy)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert echoed["logprobs"][key][-5:] == plain["logprobs"][key]
    without_logprobs = complete(guarded_server, echo=True, max_tokens=5, temperature=0)
    assert without_logprobs["choices"][0]["text"] == echoed["text"]
    assert without_logprobs["choices"][0]["logprobs"] is None


def test_a_stream_sends_the_prompt_in_its_first_chunk(guarded_server: SimpleNamespace) -> None:
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 1, "echo": True}
    whole = complete(guarded_server, **greedy)["choices"][0]
    body = {"model": guarded_server.model, "prompt": PROMPT, "stream": True} | greedy
    with guarded_server.client.stream("POST", "/v1/completions", json=body, headers=GUARD) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    token_logprobs = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert token_logprobs == pytest.approx(whole["logprobs"]["token_logprobs"], abs=TOLERANCE)


def test_vllm_prompt_logprobs_for_completions_and_chat(
    guarded_server: SimpleNamespace, tiny_chat_model_dir: Path, prompt_ids: list[int]
) -> None:
    """vLLM's shape: null, then per prompt token a dict by token id holding the token and
    the top alternatives, each with its logprob, rank and text."""
    choice = complete(guarded_server, prompt_logprobs=2, max_tokens=1)["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    reference = hf_prompt_logprobs(tiny_chat_model_dir, prompt_ids)
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    for token_id, entry, ref in zip(prompt_ids[1:], scored[1:], reference, strict=True):
        token = entry[str(token_id)]
        assert token["logprob"] == pytest.approx(ref.logprob, abs=TOLERANCE)
        assert token["rank"] == ref.rank and token["decoded_token"] == tokenizer.decode([token_id])
        top = [int(t) for t, e in entry.items() if e["rank"] <= 2]
        assert top == list(ref.top_logprobs)[:2]
        assert len(entry) == 2 + (ref.rank > 2)
    chat = guarded_server.client.post(
        "/v1/chat/completions",
        json={
            "model": guarded_server.model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
        headers=GUARD,
    ).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


BAD = [
    ({"prompt_logprobs": -1}, "/v1/completions", "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "/v1/completions", "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "/v1/completions", "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "/v1/completions", "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "/v1/chat/completions", "prompt_logprobs"),
    ({"echo": "yes"}, "/v1/completions", "echo"),
    ({"echo": True}, "/v1/chat/completions", "echo"),
    ({"echo": True, "logprobs": -1}, "/v1/completions", "logprobs"),
    ({"echo": True, "logprobs": 21}, "/v1/completions", "logprobs"),
    ({"max_tokens": 0}, "/v1/completions", "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "/v1/completions", "max_tokens"),
]


@pytest.mark.parametrize(("extra", "path", "param"), BAD)
def test_bad_values_get_a_400_naming_the_field(
    guarded_server: SimpleNamespace, extra: dict, path: str, param: str
) -> None:
    body = {"model": guarded_server.model, "max_tokens": 1} | extra
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "x"}
    r = guarded_server.client.post(path, json=body, headers=GUARD)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert complete(guarded_server, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_reads_an_echo(guarded_server: SimpleNamespace) -> None:
    client = OpenAI(base_url=f"{guarded_server.url}/v1", api_key=GUARD_KEY)
    completion = client.completions.create(
        model=guarded_server.model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    (choice,) = completion.choices
    assert choice.text == PROMPT and choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    scored = client.completions.create(
        model=guarded_server.model,
        prompt=PROMPT,
        max_tokens=1,
        extra_body={"prompt_logprobs": 1},
    )
    assert scored.choices[0].model_extra["prompt_logprobs"][0] is None


def test_a_loglikelihood_request_as_lm_evaluation_harness_sends_it(
    guarded_server: SimpleNamespace, tiny_chat_model_dir: Path, prompt_ids: list[int]
) -> None:
    """lm-evaluation-harness's local-completions: token ids (a batch of one), echo, one
    token drawn; it sums the continuation's logprobs, dropping the drawn token, and calls
    the continuation greedy when each token's logprob is its position's best."""
    context, continuation = prompt_ids[:6], prompt_ids[6:]
    body = {"prompt": [prompt_ids], "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 1234}
    choice = complete(guarded_server, temperature=0, **body)["choices"][0]
    scored = choice["logprobs"]["token_logprobs"][len(context) : -1]
    tops = choice["logprobs"]["top_logprobs"][len(context) : -1]
    reference = hf_prompt_logprobs(tiny_chat_model_dir, prompt_ids)[len(context) - 1 :]
    assert len(scored) == len(continuation)
    assert sum(scored) == pytest.approx(sum(p.logprob for p in reference), abs=1e-3)
    assert is_greedy(scored, tops) == all(p.rank == 1 for p in reference)
    # The model's own greedy continuation of the context is greedy by that measure.
    ((drawn, _),) = hf_greedy(tiny_chat_model_dir, [context], 4)
    again = complete(guarded_server, temperature=0, **body | {"prompt": [context + drawn]})
    logprobs = again["choices"][0]["logprobs"]
    tail = slice(len(context), -1)
    assert is_greedy(logprobs["token_logprobs"][tail], logprobs["top_logprobs"][tail])


def is_greedy(logprobs: list[float], tops: list[dict[str, float]]) -> bool:
    return all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))
