"""TLS on every port with real certificates and real processes over loopback: an
executor given a CA refuses every client without a certificate that CA signed, and the
scheduler, as that executor's client, still generates text on its TLS front doors."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from pagedserve.cli import main
from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1.frontdoor_pb2_grpc import FrontDoorStub
from pagedserve.settings import TlsOptions
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorError
from tests.pki import CertificateAuthority
from tests.services import free_port, start, stop, wait_healthy


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    directory = tmp_path_factory.mktemp("pki")
    ours, other = CertificateAuthority(directory, "ours"), CertificateAuthority(directory, "other")
    return SimpleNamespace(
        ca=str(ours.ca_path),
        other_ca=str(other.ca_path),
        server=tuple(map(str, ours.issue("server"))),
        client=tuple(map(str, ours.issue("client"))),
        stranger=tuple(map(str, other.issue("client"))),
    )


@pytest.fixture(scope="module")
def served(tiny_chat_model_dir: Path, pki: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """`pagedserve serve` with TLS everywhere: its executor requires client certificates
    signed by our CA, and so do its gRPC front door and HTTP API (--tls-client-auth)."""
    port, executor_port, grpc_port = free_port(), free_port(), free_port()
    args = ["serve", "--model", str(tiny_chat_model_dir), "--port", str(port)]
    args += ["--executor-port", str(executor_port), "--executor-metrics-port", "0"]
    args += ["--swap-space", "0.05", "--num-gpu-blocks", "64", "--grpc-port", str(grpc_port)]
    args += ["--tls-cert", pki.server[0], "--tls-key", pki.server[1], "--tls-ca", pki.ca]
    args += ["--tls-client-auth", "--tls-http"]
    proc = start(args, f"pagedserve-tls-{port}.log")
    context = ssl.create_default_context(cafile=pki.ca)
    context.load_cert_chain(*pki.client)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, verify=context)
        yield SimpleNamespace(
            url=url,
            context=context,
            executor=f"127.0.0.1:{executor_port}",
            frontdoor=f"127.0.0.1:{grpc_port}",
        )
    finally:
        stop(proc)


def test_tls_flags_that_cannot_work_are_refused() -> None:
    for bad in (
        {"tls_cert": "c.pem"},  # without its key
        {"tls_http": True},  # without a certificate
        {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_client_auth": True},  # without a CA
    ):
        with pytest.raises(ValueError, match="--tls"):
            TlsOptions(**bad)


def test_an_executor_asked_for_client_certificates_without_its_own_does_not_start(
    pki: SimpleNamespace, tiny_model_dir: Path
) -> None:
    args = ["executor", "--model", str(tiny_model_dir), "--port", str(free_port())]
    proc = start([*args, "--tls-ca", pki.ca], f"executor-tls-ca-only-{free_port()}.log")
    try:
        assert proc.wait(timeout=120) == 2  # before the model loads
    finally:
        stop(proc)
    assert "need --tls-cert and --tls-key" in proc.log_path.read_text()


def answers(address: str, tls: TlsOptions | None) -> bool:
    client = ExecutorClient(address, tls=tls)
    try:
        client.get_stats(timeout=10)
    except ExecutorError:
        return False
    finally:
        client.close()
    return True


def test_the_executor_takes_only_clients_with_a_certificate_of_its_ca(served, pki) -> None:
    client_cert, client_key = pki.client
    assert not answers(served.executor, None)  # plaintext
    assert not answers(served.executor, TlsOptions(tls_ca=pki.ca))  # no client certificate
    stranger = TlsOptions(tls_cert=pki.stranger[0], tls_key=pki.stranger[1], tls_ca=pki.ca)
    assert not answers(served.executor, stranger)  # signed by another CA
    ours = TlsOptions(tls_cert=client_cert, tls_key=client_key, tls_ca=pki.ca)
    assert answers(served.executor, ours)
    # ... and the client checks the executor: one that trusts only the other CA refuses it.
    wary = TlsOptions(tls_cert=client_cert, tls_key=client_key, tls_ca=pki.other_ca)
    assert not answers(served.executor, wary)
    # --tls-server-name: the name checked instead of the address dialled.
    for name, ok in (("localhost", True), ("elsewhere.example", False)):
        named = TlsOptions(client_cert, client_key, pki.ca, tls_server_name=name)
        assert answers(served.executor, named) is ok


def test_probe_reports_the_executors_health_over_mutual_tls(served, pki, capsys) -> None:
    """`pagedserve probe`, the deployments' health check, with a certificate of the CA."""
    cert, key = pki.client
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki.ca]
    assert main(["probe", served.executor, "--serving", *tls]) == 0
    assert capsys.readouterr().out == f"{served.executor}: SERVING\n"
    stranger = ["--tls-cert", pki.stranger[0], "--tls-key", pki.stranger[1], "--tls-ca", pki.ca]
    for refused in (["--tls-ca", pki.ca], stranger, []):  # no certificate, another CA's, plaintext
        assert main(["probe", served.executor, "--timeout", "2", *refused]) == 1


def test_text_comes_back_over_https_with_a_client_certificate(served, pki) -> None:
    model = httpx.get(f"{served.url}/v1/models", verify=served.context).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{served.url}/v1/completions", json=body, verify=served.context, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    no_cert = ssl.create_default_context(cafile=pki.ca)
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{served.url}/v1/completions", json=body, verify=no_cert, timeout=10)


def test_text_comes_back_on_the_tls_grpc_front_door(served, pki) -> None:
    read = [Path(p).read_bytes() for p in (pki.ca, pki.client[1], pki.client[0])]
    request = pb.GenerateRequest(text="Once upon a time", max_tokens=8)
    credentials = grpc.ssl_channel_credentials(*read)
    with grpc.secure_channel(served.frontdoor, credentials) as channel:
        text = "".join(c.text for r in FrontDoorStub(channel).Generate(request) for c in r.choices)
    assert text
    refused = [grpc.ssl_channel_credentials(read[0]), None]  # no client certificate; plaintext
    for credentials in refused:
        if credentials is None:
            channel = grpc.insecure_channel(served.frontdoor)
        else:
            channel = grpc.secure_channel(served.frontdoor, credentials)
        with channel, pytest.raises(grpc.RpcError) as info:
            list(FrontDoorStub(channel).Generate(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
