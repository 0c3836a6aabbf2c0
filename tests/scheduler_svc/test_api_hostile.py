"""A hostile client against a real `pagedserve serve` (HTTP and the gRPC front door, both
behind an API key): poison strings, deep and large bodies, numbers that overflow, made-up
Last-Event-IDs, reused request ids and calls without the key are refused with a 4xx (or
the gRPC status that says it) while the engine keeps serving."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from types import SimpleNamespace

import grpc
import httpx
import pytest

from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1.frontdoor_pb2_grpc import FrontDoorStub
from tests.services import GUARD_KEY, executor_pid, held_still

KEY = GUARD_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
KEYED = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture
def server(guarded_server: SimpleNamespace) -> SimpleNamespace:
    return guarded_server


def post(server, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


def strict_json(text: str) -> object:
    """JSON as the standard has it: NaN or Infinity fail the test."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def sse(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, list[str]]:
    """Status and ``data:`` payloads of a streamed request (every payload strict JSON)."""
    headers = {**AUTH, **(headers or {})}
    with httpx.stream(
        "POST", f"{server.url}{path}", json=body | {"stream": True}, headers=headers, timeout=30
    ) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    for payload in data[:-1]:
        strict_json(payload)
    return 200, data


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = strict_json(r.text)["error"]
    assert error["message"] and error["type"]
    return error


def still_serves(server) -> None:
    """The engine is alive: a plain request completes."""
    ok = post(server, "/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def metric_total(server, name: str) -> float:
    """The sum of a metric's samples in /metrics, whatever their labels."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


COUNTERS = (
    "pagedserve_prompt_tokens_total",
    "pagedserve_generation_tokens_total",
    "pagedserve_requests_total",
)
ABORTED = 'pagedserve_requests_total{finish_reason="abort"}'


def counters(server) -> dict[str, float]:
    """The request counters, and the requests that ended as aborted."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    aborted = re.search(rf"^{re.escape(ABORTED)} (\S+)$", text, re.M)
    assert aborted, f"{ABORTED} missing from /metrics"
    return {name: metric_total(server, name) for name in COUNTERS} | {"abort": float(aborted[1])}


# Raw JSON after the model's field ("\ud800" is the JSON escape of a lone surrogate; a key
# given twice keeps its last value), and the field the 400 names.
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
POISON = [
    ("completions", '"prompt": "Hello", "max_tokens": 8, "stop": "a\\ud800b"', "stop"),
    ("completions", '"prompt": "x", "stop": ["ok", "\\udfff"]', "stop[1]"),
    ("completions", '"prompt": "He\\ud800llo"', "prompt"),
    ("completions", '"prompt": ["He\\udbffllo"]', "prompt[0]"),
    ("completions", '"prompt": "x", "model": "m\\ud800"', "model"),
    ("completions", '"prompt": "x", "request_id": "r\\ud800"', "request_id"),
    ("completions", '"prompt": "x", "user": "\\ud800"', "user"),
    ("completions", '"prompt": "x", "logit_bias": {"\\ud800": 1}', "logit_bias"),
    ("completions", '"prompt": "x", "\\ud800": 1', None),
    ("chat", '"messages": [{"role": "user", "content": "\\ud800"}]', "messages[0].content"),
    ("chat", '"messages": [{"role": "\\ud800", "content": "a"}]', "messages[0].role"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "param"), POISON)
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server, path, raw, param):
    body = f'{{"model": {json.dumps(server.model)}, {raw}}}'.encode()
    assert error_of(post(server, PATHS[path], body), 400)["param"] == param
    still_serves(server)


def test_surrogates_in_raw_bytes_and_in_the_request_id_header_are_refused(server):
    model = json.dumps(server.model).encode()
    raw = b'{"model": ' + model + b', "prompt": "a\xed\xa0\x80b", "max_tokens": 2}'
    assert error_of(post(server, "/v1/completions", raw), 400)["param"] == "prompt"
    body = {"model": server.model, "prompt": "x", "max_tokens": 2}
    r = post(server, "/v1/completions", body, headers={"X-Request-Id": b"id-\xed\xa0\x80"})
    assert error_of(r, 400)["param"] == "X-Request-Id"
    still_serves(server)


@pytest.mark.parametrize("depth", [65, 1_000, 100_000])
def test_deep_nesting_is_a_400(server, depth):
    nested = b"[" * depth + b"]" * depth
    raw = b'{"model": "m", "prompt": "x", "metadata": ' + nested + b"}"
    assert error_of(post(server, "/v1/completions", raw), 400)["code"] == "too_deep"
    ok = {"model": server.model, "prompt": "x", "max_tokens": 2, "metadata": [[[[1]]]]}
    assert post(server, "/v1/completions", ok).status_code == 200


def test_tiny_temperatures_are_greedy_and_logprobs_stay_finite(server):
    body = {"model": server.model, "prompt": "The sea wall", "max_tokens": 6, "logprobs": 2}
    greedy = post(server, "/v1/completions", body | {"temperature": 0})
    assert greedy.status_code == 200, greedy.text
    for temperature in (1e-40, 1e-300):
        r = post(server, "/v1/completions", body | {"temperature": temperature})
        assert r.status_code == 200, r.text
        choice = strict_json(r.text)["choices"][0]
        assert choice["text"] == greedy.json()["choices"][0]["text"]
        status, data = sse(server, "/v1/completions", body | {"temperature": temperature})
        assert status == 200 and data[-1] == "[DONE]"
        chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}]}
        chat |= {"max_tokens": 4, "logprobs": True, "top_logprobs": 2, "temperature": temperature}
        status, data = sse(server, "/v1/chat/completions", chat)
        assert status == 200 and data[-1] == "[DONE]"
    call = FrontDoorStub(server.channel).Generate(
        pb.GenerateRequest(text="The sea wall", max_tokens=6, logprobs=2, temperature=1e-300),
        metadata=KEYED,
    )
    logprobs = [lp for r in call for c in r.choices for lp in c.logprobs]
    assert logprobs and all(math.isfinite(lp) for lp in logprobs)


OUT_OF_RANGE = [
    ({"frequency_penalty": -1e308, "logprobs": 2}, "frequency_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"length_penalty": 1e300}, "length_penalty"),
]


@pytest.mark.parametrize(("fields", "param"), OUT_OF_RANGE)
def test_numbers_out_of_range_are_a_400(server, fields, param):
    body = {"model": server.model, "prompt": "x", "max_tokens": 4} | fields
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


OVER_LIMITS = [  # the defaults of --max-stops and --max-messages
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop", "--max-stops"),
    (
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [1] * 17},
        "stop_token_ids",
        "--max-stops",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}] * 1025},
        "messages",
        "--max-messages",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "Hi"}] * 1025},
        "messages",
        "--max-messages",
    ),
]


@pytest.mark.parametrize(("path", "fields", "param", "flag"), OVER_LIMITS)
def test_a_request_over_a_limit_is_a_400_naming_it(server, path, fields, param, flag):
    error = error_of(post(server, path, {"model": server.model, "max_tokens": 4} | fields), 400)
    assert error["param"] == param and flag in error["message"]


def test_nan_and_infinity_as_json_text_are_a_400(server):
    for raw in ('"temperature": NaN', '"top_p": -Infinity', '"seen_at": Infinity'):
        text = f'{{"model": {json.dumps(server.model)}, "prompt": "x", {raw}}}'
        r = post(server, "/v1/completions", text.encode())
        assert error_of(r, 400)["param"] == raw.split('"')[1]


def test_grpc_refuses_overflowing_numbers(server):
    stub = FrontDoorStub(server.channel)
    for request in (
        pb.GenerateRequest(text="x", frequency_penalty=-1e308, logprobs=2),
        pb.GenerateRequest(text="x", length_penalty=1e300),
    ):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=KEYED))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def stream_ids(server, body: dict, headers: dict) -> list[str]:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=AUTH | headers, timeout=30
    ) as r:
        assert r.status_code == 200
        return [line[4:] for line in r.iter_lines() if line.startswith("id: ")]


def test_impossible_last_event_ids_are_a_400_at_once(server):
    body = {"model": server.model, "prompt": "A short one", "max_tokens": 8, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    known = f"resumable-{uuid.uuid4().hex}"
    ids = stream_ids(server, body, {"X-Request-Id": known, "X-Resumable-Stream": "true"})
    last = int(ids[-1].split(".")[0])
    assert stream_ids(server, body, {"X-Request-Id": known, "Last-Event-ID": ids[0]}) == ids[1:]
    cases = [
        (known, "99999999999999999999999.0", "event_out_of_range"),
        (known, "9.0", "event_out_of_range"),  # max_tokens + 1 events at most
        (known, f"{last + 1}.0", "event_out_of_range"),  # the request ended before
        (known, "1.1", "event_out_of_range"),  # n is 1
        (known, b"\xb2.0", "event_out_of_range"),  # a digit to str.isdigit, not to int
        ("never-submitted", "3.0", "request_not_found"),
    ]
    for request_id, last_event_id, code in cases:
        start = time.monotonic()
        headers = AUTH | {"X-Request-Id": request_id, "Last-Event-ID": last_event_id}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert error_of(r, 400)["code"] == code, last_event_id
        assert time.monotonic() - start < 5
    still_serves(server)


def test_a_reused_request_id_with_another_body_is_a_409(server):
    request_id = f"idem-{uuid.uuid4().hex}"
    body = {"model": server.model, "prompt": "The harbour at dawn", "max_tokens": 6}
    body |= {"temperature": 0, "ignore_eos": True}
    headers = {"X-Request-Id": request_id}
    first = post(server, "/v1/completions", body, headers)
    assert first.status_code == 200, first.text
    before = counters(server)
    again = post(server, "/v1/completions", body, headers)
    assert again.status_code == 200 and again.json()["choices"] == first.json()["choices"]
    assert again.json()["usage"] == first.json()["usage"]
    assert counters(server) == before  # no second prefill: the stored answer
    for other in ({"prompt": "Another prompt"}, {"max_tokens": 7}, {"temperature": 1.0}):
        r = post(server, "/v1/completions", body | other, headers)
        assert error_of(r, 409)["code"] == "request_id_conflict", other
    in_body = post(server, "/v1/completions", body | {"prompt": "Other", "request_id": request_id})
    assert error_of(in_body, 409)["code"] == "request_id_conflict"
    status, data = sse(server, "/v1/completions", body | {"prompt": "Other"}, headers)
    assert status == 409 and "request_id_conflict" in data[0]
    with pytest.raises(grpc.RpcError) as info:
        request = pb.GenerateRequest(request_id=request_id, text="Other", max_tokens=6)
        list(FrontDoorStub(server.channel).Generate(request, metadata=KEYED))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    last = post(server, "/v1/completions", body, headers)
    assert last.json()["choices"] == first.json()["choices"]
    assert counters(server) == before  # the refused reuses ran nothing either


def test_a_request_id_in_flight_is_refused_while_its_request_runs_on(server):
    """A second request under the id of one still streaming is a 409 ``conflict``,
    whatever its body; the first runs on to its end, counted once, and a retry after
    that end gets its stored answer."""
    request_id = f"in-flight-{uuid.uuid4().hex}"
    # Nearly the model's whole context: the stream must outlast the client's read of its
    # first event, which a loaded machine can delay while the tiny model's fast steps
    # (three calls on the wire) go on.
    body = {"model": server.model, "prompt": "The harbour at dawn", "max_tokens": 1000}
    body |= {"temperature": 0, "ignore_eos": True}
    headers = AUTH | {"X-Request-Id": request_id}
    before = counters(server)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body | {"stream": True}, headers=headers
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        data = [next(line[6:] for line in lines if line.startswith("data: {"))]
        # The executor held still: the first request is surely in flight meanwhile (on a
        # loaded machine six requests once took longer than its whole stream).
        with held_still(executor_pid(server.proc)):
            for other in ({}, {"prompt": "Another prompt"}, {"max_tokens": 7}):
                plain = error_of(post(server, "/v1/completions", body | other, headers), 409)
                status, streamed = sse(server, "/v1/completions", body | other, headers)
                # Another body may also be told apart by its body (request_id_conflict).
                codes = {"conflict"} if not other else {"conflict", "request_id_conflict"}
                assert status == 409 and plain["code"] in codes, other
                assert strict_json(streamed[0])["error"]["code"] in codes, other
        data += [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [strict_json(d)["choices"][0] for d in data[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    after = counters(server)
    grown = {name: after[name] - before[name] for name in after}
    assert grown["pagedserve_requests_total"] == 1 and grown["abort"] == 0
    assert grown["pagedserve_generation_tokens_total"] == body["max_tokens"]
    retry = post(server, "/v1/completions", body, headers)
    assert retry.status_code == 200, retry.text
    assert retry.json()["choices"][0]["text"] == "".join(c["text"] for c in chunks)
    assert retry.json()["usage"]["prompt_tokens"] == grown["pagedserve_prompt_tokens_total"]
    assert counters(server) == after


def test_grpc_calls_need_the_api_key(server):
    stub = FrontDoorStub(server.channel)
    request = pb.GenerateRequest(text="x", max_tokens=2)
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [r for r in stub.Generate(request, metadata=KEYED)][-1].usage.completion_tokens == 2
    raw = server.channel.unary_stream("/pagedserve.rpc.v1.FrontDoor/Generate")
    with pytest.raises(grpc.RpcError) as info:
        list(raw(b"\x12\x01\xff", metadata=KEYED))  # text: one byte of bad UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_abort_without_the_key_ends_nothing(server):
    request_id = f"keyed-{uuid.uuid4().hex}"
    body = {"model": server.model, "prompt": "Tell a long story", "max_tokens": 900}
    body |= {"ignore_eos": True, "stream": True}
    stub = FrontDoorStub(server.channel)
    reasons: list[str | None] = []

    def stream() -> None:
        headers = AUTH | {"X-Request-Id": request_id}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    before = counters(server)
    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while not reasons:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    with held_still(executor_pid(server.proc)):  # the stream surely runs meanwhile
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Abort(pb.AbortRequest(request_id=request_id), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Abort(pb.AbortRequest(request_id=request_id), metadata=KEYED).aborted
    reader.join(60)
    assert reasons[-1] == "abort"
    after = counters(server)
    grown = {name: after[name] - before[name] for name in after}
    assert grown["abort"] == 1 and grown["pagedserve_requests_total"] == 1
    assert 0 < grown["pagedserve_generation_tokens_total"] < body["max_tokens"]
