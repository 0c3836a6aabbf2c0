"""Property-based fuzzing of both front doors on ONE real `pagedserve serve` (tiny chat
model, API key, gRPC port), started once for the module.

Bodies come from the request schema (small max_tokens, so a case runs in milliseconds) and
then get mutated: wrong types, huge and negative numbers, NaN and Infinity written as JSON
text, deep nesting, long strings, lone surrogates as \\ud800 escapes, invalid UTF-8 bytes,
huge stop lists, duplicated keys, wrong content types, truncated bodies, made-up request ids
and Last-Event-IDs, a missing key. gRPC requests get out-of-range numbers and strings, and
their serialized bytes get cut, flipped and salted with bad UTF-8.

Properties: no answer is a server fault (HTTP status >= 500; gRPC INTERNAL, UNKNOWN,
UNAVAILABLE, DATA_LOSS or UNIMPLEMENTED), every error body is OpenAI-shaped JSON, every
response parses as standard JSON (no NaN or Infinity), /health stays ok, and once the
requests drain no KV block stays used.

Each test runs PAGEDSERVE_FUZZ_EXAMPLES cases (default 200), e.g.
``PAGEDSERVE_FUZZ_EXAMPLES=5000 pytest tests/scheduler_svc/test_api_fuzz.py``.
"""

from __future__ import annotations

import json
import math
import re
import time
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from tests.fuzz import FUZZ
from tests.openai_spec import assert_conforms
from tests.services import GUARD_KEY

KEY = GUARD_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_FAULTS = {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
}


@pytest.fixture
def server(guarded_server: SimpleNamespace) -> SimpleNamespace:
    return guarded_server


# -- strategies ---------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


text = st.text(max_size=40)
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=20)
NASTY = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 2**31, 2**63, 10**30, -(10**30), 10**400]),
    st.sampled_from([1e308, -1e308, 1e-300, -1e-40, math.nan, math.inf, -math.inf]),
    st.sampled_from(["", "\ud800", "a\udfffb", "x" * 20_000, "\x00", "🙂" * 100]),
    st.sampled_from([[], {}, [None], {"a": {"b": []}}, json.loads(_nested(70))]),
    text,
    st.lists(text, max_size=5),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}
    ),
    min_size=1,
    max_size=3,
)
PROMPTS = st.one_of(
    text, token_ids, st.lists(text, min_size=1, max_size=3), st.lists(token_ids, max_size=3)
)


def _fields(chat: bool, model: str) -> st.SearchStrategy[dict[str, Any]]:
    """A body as the schema has it, every optional field present or not."""
    optional = {
        "max_tokens": st.integers(1, 4),
        "n": st.integers(1, 3),
        "best_of": st.integers(1, 4),
        "use_beam_search": st.booleans(),
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e-40, 1e-300, 1e-5])),
        "top_p": st.floats(0.01, 1),
        "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
        "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 2),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.one_of(text, st.lists(text, max_size=4)),
        "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "logprobs": st.booleans() if chat else st.integers(0, 5),
        "top_logprobs": st.integers(0, 5),
        "user": text,
    }
    required = {"model": st.sampled_from([model, model, model, "other-model"])}
    required |= {"messages": MESSAGES} if chat else {"prompt": PROMPTS}
    return st.fixed_dictionaries(required, optional=optional)


@st.composite
def http_cases(draw: st.DrawFn, model: str) -> tuple[str, bytes, dict[str, str | bytes]]:
    """(path, raw body, headers) of one request, mutated or not."""
    chat = draw(st.booleans())
    body = draw(_fields(chat, model))
    keys = list(body)
    headers: dict[str, str | bytes] = {"content-type": "application/json", **AUTH}
    mutation = draw(st.sampled_from(MUTATIONS))
    if mutation == "type":
        body[draw(st.sampled_from(keys))] = draw(NASTY)
    elif mutation == "unknown":
        body[draw(st.sampled_from(["user", "logit_bias", "tools", "x"]))] = draw(NASTY)
    elif mutation == "stops":
        body["stop"] = ["a"] * draw(st.integers(17, 2000))
    raw = json.dumps(body).encode()  # NaN and Infinity come out as JSON text
    if mutation == "deep":
        depth = draw(st.sampled_from([10, 63, 65, 300, 5000]))
        raw = raw[:-1] + b', "metadata": ' + _nested(depth) + b"}"
    elif mutation == "duplicate":
        raw = raw[:-1] + b', "' + draw(st.sampled_from(keys)).encode() + b'": 1e999}'
    elif mutation == "bad utf-8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[at:]
    elif mutation == "truncated":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mutation == "not an object":
        raw = draw(st.sampled_from([b"[]", b"1", b"null", b'"s"', b"NaN", b""]))
    elif mutation == "content type":
        headers["content-type"] = draw(st.sampled_from(["text/plain", "multipart/form-data"]))
    elif mutation == "headers":
        headers["X-Request-Id"] = draw(st.sampled_from(["", "fuzz-1", "a b", "x" * 300, b"\xff"]))
        headers["Last-Event-ID"] = draw(
            st.sampled_from(["1.0", "2.0", "0.0", "5.9", "99999999999999999999.0", "x"])
        )
    elif mutation == "no key":
        del headers["Authorization"]
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw, headers


MUTATIONS = [
    "none", "type", "unknown", "stops", "deep", "duplicate", "bad utf-8", "truncated",
    "not an object", "content type", "headers", "no key",
]  # fmt: skip


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def check_http_answer(r: httpx.Response, streamed: bool) -> None:
    """A 4xx with an OpenAI error, or an answer (whole or streamed) as OpenAI's schema has it."""
    assert r.status_code < 500, r.text[:500]
    chat = r.request.url.path == "/v1/chat/completions"
    if r.status_code >= 400:
        assert strict_json(r.text)["error"]["message"], r.text
        assert_conforms("ErrorResponse", strict_json(r.text))
    elif not streamed:
        body = strict_json(r.text)
        assert body["choices"]
        assert_conforms(
            "CreateChatCompletionResponse" if chat else "CreateCompletionResponse", body
        )
    else:
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", r.text[-500:]
        schema = "CreateChatCompletionStreamResponse" if chat else "CompletionStreamChunk"
        for payload in data[:-1]:
            assert "error" not in strict_json(payload), payload
            assert_conforms(schema, strict_json(payload))


# -- gRPC -------------------------------------------------------------------------------

proto_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
GRPC_FIELDS = {  # name: (values in range, values out of it)
    "request_id": (st.text("abcdef0123456789-", min_size=1, max_size=20), st.just("x" * 300)),
    "max_tokens": (st.integers(1, 4), st.sampled_from([0, 5000, 2**32 - 1])),
    "temperature": (st.floats(0, 2), st.sampled_from([1e-300, -1.0, 3.0])),
    "top_p": (st.floats(0.01, 1), st.sampled_from([0.0, 1.5])),
    "top_k": (st.integers(1, 50), st.sampled_from([0, -2, -(2**31), 2**31 - 1])),
    "n": (st.integers(1, 3), st.sampled_from([0, 17, 2**32 - 1])),
    "best_of": (st.integers(3, 4), st.sampled_from([0, 17, 2**32 - 1])),
    "use_beam_search": (st.just(False), st.just(True)),
    "logprobs": (st.integers(0, 5), st.sampled_from([21, 2**32 - 1])),
    "stop": (st.lists(proto_text, max_size=4), st.lists(proto_text, min_size=17, max_size=40)),
    "stop_token_ids": (st.lists(st.integers(0, 49151), max_size=3), st.just([-1, 2**31 - 1])),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.just(0)),
    "ignore_eos": (st.booleans(), st.just(True)),
    "presence_penalty": (st.floats(-2, 2), st.sampled_from([-1e308, 3.0])),
    "frequency_penalty": (st.floats(-2, 2), st.sampled_from([-1e308, 3.0])),
    "repetition_penalty": (st.floats(0.1, 2), st.sampled_from([0.0, 1e-300, 1e308])),
    "min_p": (st.floats(0, 1), st.sampled_from([-0.5, 2.0])),
    "length_penalty": (st.floats(-2, 2), st.sampled_from([1e300, -1e300])),
}
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
PROMPT_IDS_OR_TEXT = st.one_of(st.text(min_size=1, max_size=40), token_ids)
BAD_PROMPTS = st.one_of(
    st.none(), st.just(""), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8)
)
DOUBLES = {
    name
    for name, field in pb.GenerateRequest.DESCRIPTOR.fields_by_name.items()
    if field.type == field.TYPE_DOUBLE
}


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """A request as the proto has it, then maybe one field out of range (or not finite)."""
    optional = {name: ok for name, (ok, _) in GRPC_FIELDS.items()}
    fields = draw(st.fixed_dictionaries({}, optional=optional))
    bad = draw(st.sampled_from([None] * 8 + [*GRPC_FIELDS, "prompt"]))
    if bad in GRPC_FIELDS:
        fields[bad] = draw(GRPC_FIELDS[bad][1])
        if bad in DOUBLES and draw(st.booleans()):
            fields[bad] = draw(NON_FINITE)
    request = pb.GenerateRequest(**fields)
    prompt = draw(BAD_PROMPTS if bad == "prompt" else PROMPT_IDS_OR_TEXT)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    return request


@st.composite
def grpc_cases(draw: st.DrawFn) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """(serialized request, metadata), the bytes mutated or not."""
    raw = draw(grpc_requests()).SerializeToString()
    mutation = draw(st.sampled_from(["none"] * 4 + ["cut", "flip", "bad utf-8", "no key"]))
    if mutation == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mutation == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :]
    elif mutation == "bad utf-8":
        raw += b"\x12\x02\xc3\x28"  # text: two bytes of bad UTF-8
    metadata = () if mutation == "no key" else (("authorization", f"Bearer {KEY}"),)
    return raw, metadata


def check_grpc_answer(call: Any) -> None:
    try:
        responses = list(call)
    except grpc.RpcError as e:
        assert e.code() not in SERVER_FAULTS, (e.code(), e.details())
        return
    for response in responses:
        response = pb.GenerateResponse.FromString(response)
        for choice in response.choices:
            assert all(math.isfinite(lp) for lp in choice.logprobs)
            tops = [e.logprob for top in choice.top_logprobs for e in top.entries]
            assert all(math.isfinite(lp) for lp in tops)


# -- the properties -----------------------------------------------------------------------


def healthy_and_drained(server) -> None:
    assert server.client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    pattern = r'^pagedserve_kv_blocks_used\{device="gpu"\} (\S+)$'
    while True:
        metrics = server.client.get("/metrics", headers=AUTH).text
        used = float(re.search(pattern, metrics, re.M).group(1))
        if used == 0:
            return
        assert time.monotonic() < deadline, f"{used} KV blocks still used after the fuzz"
        time.sleep(0.2)


def test_http_doors_answer_hostile_bodies_with_openai_errors(server):
    @FUZZ
    @given(case=http_cases(server.model))
    def one(case: tuple[str, bytes, dict[str, str | bytes]]) -> None:
        path, raw, headers = case
        r = server.client.post(path, content=raw, headers=headers)
        check_http_answer(r, r.headers.get("content-type", "").startswith("text/event-stream"))
        assert server.client.get("/health").status_code == 200

    one()
    healthy_and_drained(server)


def test_grpc_generate_answers_hostile_requests_with_client_statuses(server):
    generate = server.channel.unary_stream("/pagedserve.rpc.v1.FrontDoor/Generate")

    @FUZZ
    @given(case=grpc_cases())
    def one(case: tuple[bytes, tuple[tuple[str, str], ...]]) -> None:
        raw, metadata = case
        check_grpc_answer(generate(raw, metadata=metadata, timeout=60))

    one()
    healthy_and_drained(server)
