"""Responses as OpenAI's clients read them, on the shared guarded server: every body, every
SSE chunk and every error validates against OpenAI's published schema (tests/openai_spec);
``system_fingerprint`` everywhere, a null ``refusal`` in each chat message and its
logprobs, text parts of a message read as their joined text, and the fields that ask for
nothing (user, metadata, store, service_tier, a text response_format) accepted."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from tests.openai_spec import assert_conforms
from tests.services import GUARD_KEY

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}


def post(server: SimpleNamespace, path: str, body: dict) -> dict:
    r = server.client.post(path, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: SimpleNamespace, path: str, body: dict) -> list[dict[str, Any]]:
    """The chunks of a streamed request, which must be ``data:`` lines ended by [DONE]; the
    last one the usage chunk."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with server.client.stream("POST", path, json=body, headers=AUTH) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    return chunks


COMPLETIONS = {
    "plain": {"prompt": "The harbour", "max_tokens": 5},
    "n, logprobs, stop": {
        "prompt": "The harbour",
        "max_tokens": 8,
        "n": 2,
        "logprobs": 2,
        "stop": [".", "\n"],
        "seed": 3,
    },
    "token ids, greedy": {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
    "logprobs 0": {"prompt": [0], "max_tokens": 3, "logprobs": 0},
}
CHATS = {
    "plain": {"max_tokens": 5},
    "n, logprobs, stop": {
        "max_tokens": 8,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ".",
    },
    "greedy": {"max_completion_tokens": 4, "temperature": 0},
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body", COMPLETIONS.values(), ids=COMPLETIONS.keys())
def test_completions_conform_whole_and_streamed(guarded_server: SimpleNamespace, body: dict):
    server = guarded_server
    body = body | {"model": server.model}
    whole = post(server, "/v1/completions", body)
    assert_conforms("CreateCompletionResponse", whole)
    chunks = stream(server, "/v1/completions", body)
    for chunk in chunks:
        assert_conforms("CompletionStreamChunk", chunk)
    if body.get("temperature") == 0:
        assert chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("body", CHATS.values(), ids=CHATS.keys())
def test_chat_completions_conform_whole_and_streamed(guarded_server: SimpleNamespace, body):
    server = guarded_server
    body = body | {"model": server.model, "messages": MESSAGES}
    whole = post(server, "/v1/chat/completions", body)
    assert_conforms("CreateChatCompletionResponse", whole)
    chunks = stream(server, "/v1/chat/completions", body)
    for chunk in chunks:
        assert_conforms("CreateChatCompletionStreamResponse", chunk)
    if body.get("temperature") == 0:
        assert chunks[-1]["usage"] == whole["usage"]


def test_beam_search_and_best_of_conform(guarded_server: SimpleNamespace) -> None:
    server = guarded_server
    base = {"model": server.model, "max_tokens": 4, "n": 2, "best_of": 3}
    beams = base | {"use_beam_search": True}
    assert_conforms(
        "CreateCompletionResponse", post(server, "/v1/completions", beams | {"prompt": "A"})
    )
    chat = base | {"messages": MESSAGES, "logprobs": True}
    assert_conforms("CreateChatCompletionResponse", post(server, "/v1/chat/completions", chat))


def test_models_conform(guarded_server: SimpleNamespace) -> None:
    r = guarded_server.client.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    assert_conforms("ListModelsResponse", r.json())


ERRORS = {
    "bad field": ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, AUTH, 400),
    "bad JSON": ("POST", "/v1/chat/completions", b"{", AUTH, 400),
    "unknown model": ("POST", "/v1/chat/completions", {"model": "nope"}, AUTH, 404),
    "unknown path": ("GET", "/v1/nothing", None, AUTH, 404),
    "wrong method": ("GET", "/v1/completions", None, AUTH, 405),
    "no key": ("GET", "/v1/models", None, {}, 401),
    "wrong key": ("POST", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer x"}, 401),
}


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), ERRORS.values(),
                         ids=ERRORS.keys())  # fmt: skip
def test_errors_conform(guarded_server: SimpleNamespace, method, path, body, headers, status):
    server = guarded_server
    if isinstance(body, dict):
        body = json.dumps({"model": server.model, "messages": MESSAGES} | body).encode()
    r = server.client.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert_conforms("ErrorResponse", r.json())


def test_responses_carry_the_fields_openai_clients_read(guarded_server: SimpleNamespace) -> None:
    server = guarded_server
    base = {"model": server.model, "max_tokens": 6, "temperature": 0}
    asked = {"messages": [{"role": "user", "content": "Hi\nthere"}], "logprobs": True}
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    ignored |= {"response_format": {"type": "text"}, "tool_choice": "none"}
    plain = post(server, "/v1/chat/completions", base | asked)
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    parted = base | asked | ignored | {"messages": [{"role": "user", "content": parts}]}
    body = post(server, "/v1/chat/completions", parted)
    assert body["system_fingerprint"].startswith("pagedserve-")
    message = body["choices"][0]["message"]
    assert message["refusal"] is None
    assert message["content"] == plain["choices"][0]["message"]["content"]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    completion = post(server, "/v1/completions", base | {"prompt": "x"})
    assert completion["system_fingerprint"] == body["system_fingerprint"]
    chunks = stream(server, "/v1/chat/completions", parted)
    assert chunks and all(c["system_fingerprint"] == body["system_fingerprint"] for c in chunks)
