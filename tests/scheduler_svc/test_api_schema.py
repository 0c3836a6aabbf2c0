"""The API describes itself: /openapi.json and /docs open on the shared guarded server,
each route's typed request and response models, real answers valid against them, and
every field the parser reads documented in the request models."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from pagedserve.settings import ApiConfig
from scheduler_svc.api.protocol import _UNSUPPORTED, parse_completion
from scheduler_svc.api.schema import ROUTES, ChatCompletionRequest, CompletionRequest
from tests.services import GUARD_KEY

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


def validator(document: dict[str, Any], component: str) -> Draft202012Validator:
    root = {"components": document["components"], "$ref": f"#/components/schemas/{component}"}
    return Draft202012Validator(root)


def test_openapi_describes_each_route_and_real_answers_fit(guarded_server) -> None:
    server = guarded_server
    document = server.client.get("/openapi.json").json()  # no key: no request data there
    assert "swagger-ui" in server.client.get("/docs").text
    for schema in document["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    completion = {"model": server.model, "prompt": ["a", "b"], "max_tokens": 2, "n": 2}
    chat = {"model": server.model, "messages": MESSAGES, "max_completion_tokens": 2}
    calls = [
        ("post", "/v1/completions", completion),
        ("post", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 1}),
        ("get", "/v1/models", None),
        ("get", "/v1/models/{model}", None),
        ("post", "/tokenize", {"messages": MESSAGES, "return_token_strs": True}),
        ("post", "/detokenize", {"tokens": [1, 2]}),
        ("get", "/version", None),
    ]
    assert {(method, path) for method, path, _ in calls} == set(ROUTES)  # each one tried
    for method, path, body in calls:
        operation = document["paths"][path][method]
        if body is not None:
            request_ref = operation["requestBody"]["content"]["application/json"]["schema"]
            validator(document, request_ref["$ref"].rsplit("/", 1)[1]).validate(body)
        url = path.replace("{model}", server.model)
        r = server.client.request(method, url, json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        answer_ref = operation["responses"]["200"]["content"]["application/json"]["schema"]
        validator(document, answer_ref["$ref"].rsplit("/", 1)[1]).validate(r.json())
    refused = server.client.post("/v1/completions", json=completion | {"n": 0}, headers=AUTH)
    validator(document, "ErrorResponse").validate(refused.json())


class Reads(dict):
    """A body that records which fields the parser looks at."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)


@pytest.mark.parametrize(
    ("model", "body", "chat"),
    [
        (CompletionRequest, {"model": "m", "prompt": "x"}, False),
        (ChatCompletionRequest, {"model": "m", "messages": MESSAGES}, True),
    ],
)
def test_every_field_the_parser_reads_is_documented(model, body, chat) -> None:
    body = Reads(body)
    parse_completion(body, ApiConfig(), chat)
    assert body.read - set(_UNSUPPORTED) <= set(model.model_fields), sorted(body.read)
