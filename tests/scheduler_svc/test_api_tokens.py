"""vLLM's /tokenize, /detokenize and /version on the shared guarded server: the token ids
the completion endpoints count, text back from them, errors naming the field, and the
API key required as on every route with data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.openai_spec import assert_conforms
from tests.services import GUARD_KEY

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def call(server: SimpleNamespace, path: str, body: dict) -> dict:
    r = server.client.post(path, json={"model": server.model} | body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_counts_what_the_completions_count(guarded_server: SimpleNamespace) -> None:
    server = guarded_server
    one_token = {"max_tokens": 1}
    text = "The harbour committee met on a grey morning"
    tokens = call(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    completion = call(server, "/v1/completions", one_token | {"prompt": text})
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    card = server.client.get("/v1/models", headers=AUTH).json()["data"][0]
    assert tokens["max_model_len"] == card["max_model_len"]
    assert len(tokens["token_strs"]) == tokens["count"]
    chat = call(server, "/tokenize", {"messages": MESSAGES})
    answered = call(server, "/v1/chat/completions", one_token | {"messages": MESSAGES})
    assert chat["count"] == answered["usage"]["prompt_tokens"] and chat["token_strs"] is None
    bare = call(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    assert call(server, "/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": text}


def test_version_names_the_build_in_the_fingerprint(guarded_server: SimpleNamespace) -> None:
    server = guarded_server
    version = server.client.get("/version", headers=AUTH).json()["version"]
    fingerprint = call(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert fingerprint["system_fingerprint"] == f"pagedserve-{version}"


BAD = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 99999999]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_bodies_are_refused_naming_the_field(guarded_server, path, body, status, param):
    r = guarded_server.client.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert_conforms("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/version"])
def test_the_api_key_is_required(guarded_server: SimpleNamespace, path: str) -> None:
    method = "GET" if path == "/version" else "POST"
    body = {"prompt": "x", "tokens": [1]} if method == "POST" else None
    r = guarded_server.client.request(method, path, json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
