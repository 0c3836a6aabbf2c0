"""The OpenAI-compatible API over real processes: `pagedserve serve` (executor and
scheduler talking gRPC over loopback), raw HTTP and the official `openai` client."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from pagedserve.cli import SERVE_GOMP_SPINCOUNT, executor_environ
from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ExecutorConfig
from tests.services import executor_pid, held_still, serving

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path):
    flags = ["--num-gpu-blocks", "96", "--api-key", KEY, "--enable-prefix-caching"]
    with serving(tiny_chat_model_dir, *flags) as proc:
        yield proc.url, tiny_chat_model_dir.name, proc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server[0]}/v1", api_key=KEY)


def model_of(server) -> str:
    return httpx.get(f"{server[0]}/v1/models", headers=AUTH).json()["data"][0]["id"]


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **kw.pop("headers", {})}
    return httpx.post(f"{server[0]}{path}", content=content, headers=headers, timeout=60, **kw)


def metric(server, name: str, label: str) -> float:
    text = httpx.get(f"{server[0]}/metrics", headers=AUTH).text
    pattern = rf"^{name}\{{{label}\}} (\S+)$" if label else rf"^{name} (\S+)$"
    match = re.search(pattern, text, re.M)
    assert match, f"{name}{{{label}}} missing from /metrics"
    return float(match.group(1))


def test_greedy_completion_equals_the_in_process_engine(server, tiny_chat_model_dir):
    model = model_of(server)
    prompt = "The harbour committee met on a grey morning"
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    served = post(server, "/v1/completions", body).json()
    llm = OfflineLLM(
        ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = llm.generate([Request("a", prompt=prompt, params=params)], progress=False)[0]
    assert served["choices"][0]["text"] == offline.outputs[0].text
    assert served["usage"] == {
        "prompt_tokens": len(offline.prompt_token_ids),
        "completion_tokens": 12,
        "total_tokens": len(offline.prompt_token_ids) + 12,
    }


@pytest.mark.parametrize("resumable", [False, True], ids=["openai-style", "resumable"])
def test_streaming_sends_the_same_text_in_events(server, resumable):
    """By default only ``data:`` lines, as OpenAI sends them (vLLM's benchmark client reads
    each non-empty line as ``data: JSON``); with X-Resumable-Stream each output's event
    also carries its id for Last-Event-ID."""
    body = {
        "model": model_of(server),
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    headers = AUTH | ({"X-Resumable-Stream": "true"} if resumable else {})
    with httpx.stream(
        "POST",
        f"{server[0]}/v1/completions",
        json=body | {"stream": True},
        headers=headers,
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    ids = [line[4:] for line in lines if line.startswith("id: ")]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    if resumable:
        assert ids == [f"{i}.0" for i in range(1, len(ids) + 1)] and len(ids) == len(data) - 1
    else:
        assert len(data) == len(lines)  # nothing but data lines
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_with_the_openai_client_n_seed_and_logprobs(server, client):
    model = model_of(server)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    kw = {
        "model": model,
        "messages": messages,
        "max_tokens": 8,
        "n": 3,
        "seed": 11,
        "temperature": 1.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    first, second = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len(first.choices) == 3 and first.usage.completion_tokens > 0
    content = first.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    greedy = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    assert "".join(pieces) == greedy.choices[0].message.content


def test_beam_search_and_best_of(server, client):
    model = model_of(server)
    beams = client.completions.create(
        model=model,
        prompt="A quiet harbour",
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True},
    )
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text
    best = client.completions.create(
        model=model, prompt="A quiet harbour", max_tokens=6, n=1, best_of=3, seed=5
    )
    assert len(best.choices) == 1


def test_stop_string_cuts_the_text(server):
    body = {
        "model": model_of(server),
        "prompt": "The sea wall",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    cut = post(server, "/v1/completions", body | {"stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"


BAD_REQUESTS = [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "M", "prompt": ""}, 400, "prompt"),
    ({"model": "M"}, 400, "prompt"),
    ({"model": "M", "prompt": 5}, 400, "prompt"),
    ({"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "M", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "M", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": "M", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "M", "prompt": "x", "n": 99}, 400, "n"),
    ({"model": "M", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": "M", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "M", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "M", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "M", "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": "M", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    # Past what the executor's wire format holds: these once ended the engine loop.
    ({"model": "M", "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": "M", "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ({"model": "M", "prompt": "x", "top_k": 2**40}, 400, "top_k"),
    ({"model": "M", "prompt": "x", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    ({"model": "M", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": "M", "prompt": "x", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ({"model": "M", "prompt": [1, 2, 99999999]}, 400, "prompt"),
    ({"model": "M", "prompt": "x", "stream": True, "best_of": 2}, 400, "stream"),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ({"model": "M", "prompt": "x", "suffix": "y"}, 400, "suffix"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, param):
    if body.get("model") == "M":
        body = body | {"model": model_of(server)}
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = post(
        server, "/v1/completions", {"model": model_of(server), "prompt": "x", "max_tokens": 1}
    )
    assert ok.status_code == 200


USER = {"role": "user", "content": "Hi"}
CHAT_BAD_REQUESTS = [
    ({"messages": [USER]}, 400, "model"),
    ({"model": 5, "messages": [USER]}, 400, "model"),
    ({"model": "M"}, 400, "messages"),
    ({"model": "M", "messages": []}, 400, "messages"),
    ({"model": "M", "messages": "Hi"}, 400, "messages"),
    ({"model": "M", "messages": USER}, 400, "messages"),
    ({"model": "M", "messages": ["Hi"]}, 400, "messages[0]"),
    ({"model": "M", "messages": [{"content": "Hi"}]}, 400, "messages[0]"),
    ({"model": "M", "messages": [{"role": 5, "content": "Hi"}]}, 400, "messages[0]"),
    ({"model": "M", "messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"model": "M", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0]"),
    ({"model": "M", "messages": [USER | {"content": [{"type": "image_url", "image_url": {
        "url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]"),
    ({"model": "M", "messages": [USER | {"content": ["Hi"]}]}, 400, "messages[0].content[0]"),
    ({"model": "M", "messages": [USER | {"content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0]"),
    ({"model": "M", "messages": [USER], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ({"model": "M", "messages": [USER], "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ({"model": "M", "messages": [USER], "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ({"model": "M", "messages": [USER], "logit_bias": {"50": 10}}, 400, "logit_bias"),
    ({"model": "M", "messages": [USER, USER | {"content": None}]}, 400, "messages[1]"),
    ({"model": "M", "messages": [USER], "n": 0}, 400, "n"),
    ({"model": "M", "messages": [USER], "n": 99}, 400, "n"),
    ({"model": "M", "messages": [USER], "n": True}, 400, "n"),
    ({"model": "M", "messages": [USER], "temperature": 3}, 400, "temperature"),
    ({"model": "M", "messages": [USER], "temperature": -1}, 400, "temperature"),
    ({"model": "M", "messages": [USER], "temperature": "hot"}, 400, "temperature"),
    ({"model": "M", "messages": [USER], "top_p": 0}, 400, "top_p"),
    ({"model": "M", "messages": [USER], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "M", "messages": [USER], "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": "M", "messages": [USER | {"content": "x" * 20000}]}, 400, "max_tokens"),
    ({"model": "M", "messages": [USER], "logprobs": 3}, 400, "logprobs"),
    ({"model": "M", "messages": [USER], "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ({"model": "M", "messages": [USER], "stop": [""]}, 400, "stop"),
    ({"model": "M", "messages": [USER], "stream": "yes"}, 400, "stream"),
    ({"model": "M", "messages": [USER], "stream": True, "n": 2, "best_of": 3}, 400, "stream"),
    ({"model": "M", "messages": [USER], "seed": 2**70}, 400, "seed"),
    ({"model": "no-such-model", "messages": [USER]}, 404, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), CHAT_BAD_REQUESTS)
def test_bad_chat_input_gets_an_openai_error_and_the_server_keeps_serving(
    server, body, status, param
):
    if body.get("model") == "M":
        body = body | {"model": model_of(server)}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert error["code"] == ("model_not_found" if status == 404 else None), error
    assert error["message"]
    ok = {"model": model_of(server), "messages": [USER], "max_tokens": 1}
    assert post(server, "/v1/chat/completions", ok).status_code == 200


def test_malformed_oversized_and_unknown(server):
    assert post(server, "/v1/completions", b"{not json").status_code == 400
    big = post(server, "/v1/completions", b"x" * (5 << 20))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server[0]}/health").status_code == 200  # open without a key
    assert httpx.get(f"{server[0]}/v2/nothing", headers=AUTH).json()["error"]["message"]


UNAUTHORIZED = {
    "missing": {},
    "wrong key": {"Authorization": "Bearer wrong"},
    "key with a suffix": {"Authorization": f"Bearer {KEY}x"},
    "no scheme": {"Authorization": KEY},
    "another scheme": {"Authorization": f"Basic {KEY}"},
}


@pytest.mark.parametrize("headers", UNAUTHORIZED.values(), ids=UNAUTHORIZED.keys())
def test_a_missing_or_wrong_api_key_is_a_401_with_an_openai_error(server, headers):
    chat = {"model": model_of(server), "messages": [USER], "max_tokens": 1}
    answers = [
        httpx.post(f"{server[0]}/v1/completions", json={"prompt": "x"} | chat, headers=headers),
        httpx.post(f"{server[0]}/v1/chat/completions", json=chat, headers=headers),
        httpx.get(f"{server[0]}/v1/models", headers=headers),
        httpx.get(f"{server[0]}/metrics", headers=headers),
    ]
    for r in answers:
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["message"] and error["param"] is None
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(server):
    wrong = OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(AuthenticationError) as info:
        wrong.chat.completions.create(model=model_of(server), messages=[USER], max_tokens=1)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def running(server) -> bool:
    return metric(server, "pagedserve_num_requests", 'state="running"') > 0


def finished(server) -> dict[str, float]:
    """pagedserve_requests_total by finish reason."""
    reasons = ("stop", "length", "abort")
    return {r: metric(server, "pagedserve_requests_total", f'finish_reason="{r}"') for r in reasons}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_is_aborted_and_frees_its_blocks(server, stream):
    max_tokens = 900
    body = {
        "model": model_of(server),
        "prompt": "Tell a very long story",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    before = finished(server)
    generated = metric(server, "pagedserve_generation_tokens_total", "")
    host, port = server[0].removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    received, deadline = b"", time.monotonic() + 30
    while not (b"data:" in received if stream else running(server)):  # until it runs
        assert time.monotonic() < deadline, "the request never started"
        if stream:
            received += sock.recv(65536)
        else:
            time.sleep(0.05)
    assert metric(server, "pagedserve_kv_blocks_used", 'device="gpu"') > 0
    # The executor held still while the client leaves: the request surely runs on then.
    with held_still(executor_pid(server[2])):
        sock.close()
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while running(server) or finished(server) == before:
        assert time.monotonic() < deadline, "the disconnected request still runs"
        time.sleep(0.1)
    assert finished(server) == before | {"abort": before["abort"] + 1}
    generated = metric(server, "pagedserve_generation_tokens_total", "") - generated
    assert 0 < generated < max_tokens
    assert metric(server, "pagedserve_kv_blocks_used", 'device="gpu"') == 0
    # A client going away is no server error: nothing logged its cancellation as one.
    log = Path(tempfile.gettempdir()) / f"pagedserve-serve-{port}.log"
    assert "Exception in ASGI application" not in log.read_text()


def test_preemption_under_load_and_prefix_sharing(server, client):
    model = model_of(server)
    system = "You are a careful harbour engineer who answers in full sentences. " * 4
    before = metric(server, "pagedserve_prefix_cache_hits_total", "")
    results: list = [None] * 8
    start = threading.Barrier(8)

    # 8 x ~450 tokens need twice the 96 blocks of 16: even requests that a busy machine
    # staggers by half a run still outgrow the pool together.
    def one(i: int) -> None:
        start.wait()
        results[i] = client.completions.create(
            model=model,
            prompt=f"{system} Question {i}:",
            max_tokens=400,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None and r.usage.completion_tokens == 400 for r in results)
    assert metric(server, "pagedserve_preemptions_total", 'mode="recompute"') > 0
    assert metric(server, "pagedserve_prefix_cache_hits_total", "") > before
    assert metric(server, "pagedserve_kv_blocks_used", 'device="gpu"') == 0


def _child_environ(parent_argv_has: bytes) -> dict[bytes, bytes]:
    """The environment of the `pagedserve executor` whose parent's argv holds the given entry."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"executor" in argv and b"serve" in parent and parent_argv_has in parent:
            return dict(entry.split(b"=", 1) for entry in environ if b"=" in entry)
    raise AssertionError(f"no executor child of a serve with {parent_argv_has!r}")


def test_serve_starts_its_executor_with_short_openmp_spins(server) -> None:
    # The executor shares the machine with the scheduler: its idle OpenMP worker must not spin on.
    env = _child_environ(server[0].rsplit(":", 1)[1].encode())
    assert env[b"GOMP_SPINCOUNT"] == SERVE_GOMP_SPINCOUNT.encode()
    assert executor_environ({"GOMP_SPINCOUNT": "5", "A": "1"}) == {"GOMP_SPINCOUNT": "5", "A": "1"}
