"""Responses as OpenAI's clients read them, on the shared guarded server:
``system_fingerprint`` on every response and chunk, a null ``refusal`` in each chat message
and its logprobs, text parts of a message read as their joined text, and the fields that ask
for nothing (user, metadata, store, service_tier, a text response_format) accepted."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.services import GUARD_KEY

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}


def post(server: SimpleNamespace, path: str, body: dict) -> dict:
    r = server.client.post(path, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


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
    with server.client.stream(
        "POST", "/v1/chat/completions", json=parted | {"stream": True}, headers=AUTH
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(c["system_fingerprint"] == body["system_fingerprint"] for c in chunks)
