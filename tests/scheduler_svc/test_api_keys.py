"""A served scheduler with keys from the environment and a key file: every key opens
every door, nothing else does, and no key shows in the process list or the logs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1.frontdoor_pb2_grpc import FrontDoorStub
from tests.services import executor_pid, free_port, held_still, start, stop, wait_healthy

ENV_KEYS = ("env-key-3f9a", "env-key-77c1")
FILE_KEYS = ("file-key-b20e",)
KEYS = ENV_KEYS + FILE_KEYS


@pytest.fixture(scope="module")
def keyed(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text("# one key a line\n" + "\n".join(FILE_KEYS) + "\n")
    port, grpc_port = free_port(), free_port()
    args = ["serve", "--model", str(tiny_chat_model_dir), "--port", str(port)]
    args += ["--executor-port", str(free_port()), "--executor-metrics-port", "0"]
    args += ["--swap-space", "0.05", "--num-gpu-blocks", "64", "--grpc-port", str(grpc_port)]
    args += ["--api-key-file", str(key_file)]
    proc = start(args, f"pagedserve-keys-{port}.log", {"PAGEDSERVE_API_KEY": ",".join(ENV_KEYS)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield SimpleNamespace(url=url, proc=proc, channel=channel)
    finally:
        stop(proc)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_key_opens_every_route_and_nothing_else_does(keyed) -> None:
    body = {"model": "x", "prompt": "Hello", "max_tokens": 2}
    model = httpx.get(f"{keyed.url}/v1/models", headers=bearer(KEYS[0])).json()["data"][0]["id"]
    for key in KEYS:
        r = httpx.post(
            f"{keyed.url}/v1/completions",
            json=body | {"model": model},
            headers=bearer(key),
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        for path in ("/metrics", "/dashboard/state"):
            assert httpx.get(keyed.url + path, headers=bearer(key)).status_code == 200
    for headers in ({}, bearer("wrong"), {"Authorization": KEYS[0]}, bearer(",".join(ENV_KEYS))):
        for path in ("/metrics", "/dashboard/state", "/v1/models"):
            r = httpx.get(keyed.url + path, headers=headers)
            assert r.status_code == 401, path
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    for path in ("/health", "/dashboard", "/openapi.json"):  # no request data behind them
        assert httpx.get(keyed.url + path).status_code == 200


def test_the_grpc_door_takes_every_key(keyed) -> None:
    stub = FrontDoorStub(keyed.channel)
    request = pb.GenerateRequest(text="Hi", max_tokens=2)
    for key in KEYS:
        metadata = (("authorization", f"Bearer {key}"),)
        assert list(stub.Generate(request, metadata=metadata))[-1].usage.completion_tokens == 2
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, metadata=(("authorization", "Bearer wrong"),)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_key_aborts_only_its_own_requests(keyed) -> None:
    stub = FrontDoorStub(keyed.channel)
    request = pb.GenerateRequest(text="Tell a long story", max_tokens=900, ignore_eos=True)
    request.request_id = f"owned-{uuid.uuid4().hex}"
    owner, other = ((("authorization", f"Bearer {k}"),) for k in (ENV_KEYS[0], FILE_KEYS[0]))
    stream = stub.Generate(request, metadata=owner)
    next(stream)  # running
    abort = pb.AbortRequest(request_id=request.request_id)
    with held_still(executor_pid(keyed.proc)):  # the request surely runs meanwhile
        assert not stub.Abort(abort, metadata=other).aborted
        assert stub.Abort(abort, metadata=owner).aborted
    last = list(stream)[-1]
    assert last.usage.completion_tokens < request.max_tokens


def test_no_key_shows_in_the_process_list_or_the_logs(keyed) -> None:
    for key in ("wrong-key-5d1c", *KEYS):  # a refused key must not be logged either
        httpx.post(f"{keyed.url}/v1/completions", content=b"{", headers=bearer(key))
    for pid in Path("/proc").glob("[0-9]*"):  # Linux; elsewhere the logs alone are checked
        try:
            if os.getpgid(int(pid.name)) != keyed.proc.pid:
                continue
            cmdline = (pid / "cmdline").read_bytes()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        assert not any(key.encode() in cmdline for key in KEYS)
    log = keyed.proc.log_path.read_text()
    assert not any(key in log for key in (*KEYS, "wrong-key-5d1c"))
