"""Failures on our side, as clients see them: a stream that breaks ends with an error event
and ``[DONE]`` (HTTP) or a status (gRPC), a request while the store is away gets a 503 to
retry, and an error our code did not expect is a JSON 500 logged with its request id. Real
processes: `pagedserve serve` on a redis-server of its own, killed to make the store
unreachable."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import structlog

from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1.frontdoor_pb2_grpc import FrontDoorStub
from scheduler_svc.api.errors import client_error
from tests.openai_spec import assert_conforms
from tests.redis_server import RedisServer
from tests.services import executor_pid, free_port, held_still, start, stop, wait_healthy

pytestmark = pytest.mark.redis
LONG = {"prompt": "Tell a very long story", "max_tokens": 900, "ignore_eos": True}


@pytest.fixture
def on_private_redis(
    tiny_chat_model_dir: Path,
    private_redis: RedisServer,
) -> Iterator[tuple[str, str, subprocess.Popen, RedisServer]]:
    """`pagedserve serve` with its state in a redis-server of its own; yields the HTTP URL,
    the gRPC address, the server process and the redis-server."""
    redis_url, redis_proc = private_redis.url, private_redis
    port, grpc_port = free_port(), free_port()
    args = ["serve", "--model", str(tiny_chat_model_dir), "--port", str(port)]
    args += ["--executor-port", str(free_port()), "--executor-metrics-port", "0"]
    args += ["--swap-space", "0.05", "--num-gpu-blocks", "96", "--state-store", redis_url]
    args += ["--grpc-port", str(grpc_port), "--namespace", "failures", "--store-budget", "2"]
    proc = start(args, f"pagedserve-failures-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, f"127.0.0.1:{grpc_port}", proc, redis_proc
    finally:
        stop(proc)


def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_broken_stream_ends_with_an_error_event_and_done(on_private_redis):
    url, address, proc, redis_proc = on_private_redis
    body = {"model": model_of(url), **LONG, "stream": True}
    grpc_status: list[grpc.StatusCode] = []

    def follow_grpc() -> None:
        with grpc.insecure_channel(address) as channel:
            call = FrontDoorStub(channel).Generate(
                pb.GenerateRequest(text=LONG["prompt"], max_tokens=900, ignore_eos=True)
            )
            try:
                for _ in call:
                    pass
                grpc_status.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                grpc_status.append(e.code())

    follower = threading.Thread(target=follow_grpc)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # under way
        # The executor held still: both streams surely run when the store goes away.
        with held_still(executor_pid(proc)):
            follower.start()
            time.sleep(0.5)  # the gRPC stream is under way too
            redis_proc.kill()  # every commit and read of the store fails from here on
        data = [line[6:] for line in lines if line.startswith("data: ")]
    follower.join(60)
    errors = [json.loads(d)["error"] for d in data if d.startswith('{"error"')]
    assert data[-1] == "[DONE]" and len(errors) == 1, data[-3:]
    assert errors[0]["message"] and errors[0]["type"] == "server_error", errors
    assert data[-2].startswith('{"error"')  # nothing after the error but [DONE]
    assert_conforms("ErrorResponse", json.loads(data[-2]))
    assert grpc_status in ([grpc.StatusCode.UNAVAILABLE], [grpc.StatusCode.INTERNAL])


def test_a_request_while_the_store_is_away_gets_a_503_to_retry(on_private_redis):
    url, _, _, redis_proc = on_private_redis
    model = model_of(url)
    redis_proc.kill()  # the store is gone before the request: submitting it fails
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 2},
        headers={"X-Request-Id": "early-1"},
        timeout=60,
    )
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "store_unavailable"


def test_an_error_our_code_did_not_expect_is_a_500_logged_with_the_request_id():
    with structlog.testing.capture_logs() as logged:
        error = client_error(KeyError("internal detail"), "doomed-1")
    assert (error.status, error.code, error.type) == (500, "internal_error", "server_error")
    assert "internal detail" not in error.message  # the server's insides stay in its log
    assert [(e["event"], e["request_id"], e["log_level"]) for e in logged] == [
        ("request failed", "doomed-1", "error")
    ]
