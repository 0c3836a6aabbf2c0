"""scripts/make_certs.sh: certificates the services accept for the names they are dialled
by, and a Redis ACL and URL that a real redis-server, started as docker-compose.yml starts
it, takes; an executor and a scheduler with docker-compose.yml's environment serve text."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.deploy.manifests import SAMPLE_STATE_STORE, compose_config, make_secrets
from tests.deploy.test_compose import compose_env
from tests.services import free_port, start, stop, wait_healthy

SERVICES = ("executor", "scheduler", "redis")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_secrets(tmp_path_factory.mktemp("secrets"))


def _state_store(secrets: Path) -> str:
    line = (secrets / "redis.env").read_text()
    assert line.startswith("PAGEDSERVE_STATE_STORE=") and line.count("\n") == 1
    return line.strip().partition("=")[2]


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_gets_a_certificate_of_the_ca_for_its_names(
    secrets: Path, service: str
) -> None:
    folder = secrets / service
    assert {"tls.crt", "tls.key", "ca.crt"} <= {p.name for p in folder.iterdir()}
    assert (folder / "ca.crt").read_bytes() == (secrets / "ca.crt").read_bytes()
    assert not (folder / "ca.key").exists()
    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((secrets / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert {service, f"{service}.pagedserve.svc", "localhost"} <= set(dns)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)


def test_the_url_is_the_one_the_deployments_expect_with_a_fresh_password(secrets: Path) -> None:
    url = urlsplit(_state_store(secrets))
    sample = urlsplit(SAMPLE_STATE_STORE)
    assert url._replace(netloc=url.hostname) == sample._replace(netloc=sample.hostname)
    assert (url.username, url.port) == (sample.username, sample.port)
    assert len(url.password) == 64
    digest = hashlib.sha256(url.password.encode()).hexdigest()
    assert f"user pagedserve on #{digest} " in (secrets / "redis" / "users.acl").read_text()
    assert url.password not in (secrets / "redis" / "users.acl").read_text()


@pytest.fixture
def redis_server(secrets: Path, tmp_path: Path) -> Iterator[int]:
    """redis-server with docker-compose.yml's command, the mount /etc/redis/secrets being
    ``secrets/redis`` and the port a free one."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server (with TLS) is not installed (.ci/run installs it)")
    port = free_port()
    command = compose_config()["services"]["redis"]["command"]
    command = [a.replace("/etc/redis/secrets", str(secrets / "redis")) for a in command]
    command[command.index("--tls-port") + 1] = str(port)
    proc = subprocess.Popen([*command, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while _ping(secrets, port) != "PONG":
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ping(secrets: Path, port: int) -> str:
    """docker-compose.yml's health check, against ``port``."""
    test = compose_config()["services"]["redis"]["healthcheck"]["test"][1:]
    test = [a.replace("/etc/redis/secrets", str(secrets / "redis")) for a in test]
    done = subprocess.run([test[0], "-p", str(port), *test[1:]], capture_output=True, text=True)
    return done.stdout.strip()


def test_redis_takes_the_url_and_refuses_everyone_else(redis_server: int, secrets: Path) -> None:
    url = _state_store(secrets).replace("@redis:6379", f"@127.0.0.1:{redis_server}")
    url = url.replace("/etc/pagedserve/tls", str(secrets / "scheduler"))
    client = redis.Redis.from_url(url)
    assert client.set("k", "v") and client.get("k") == b"v"
    anonymous = redis.Redis(port=redis_server, ssl=True, ssl_ca_certs=str(secrets / "ca.crt"))
    assert anonymous.ping()  # the health checks' default user may PING, and nothing else
    with pytest.raises(redis.exceptions.NoPermissionError):
        anonymous.get("k")
    wrong = urlsplit(url)._replace(netloc=f"pagedserve:guess@127.0.0.1:{redis_server}").geturl()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(wrong).ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=redis_server, socket_timeout=2).ping()  # plaintext


def _environment(service: str, secrets: Path, redis_port: int) -> dict[str, str]:
    """docker-compose.yml's environment of ``service`` with its env_file and mounts made
    here, Redis at ``redis_port`` and no API keys."""
    url = _state_store(secrets).replace("@redis:6379", f"@127.0.0.1:{redis_port}")
    env = compose_env(compose_config()["services"][service]) | {"PAGEDSERVE_STATE_STORE": url}
    env.pop("PAGEDSERVE_API_KEY", None)
    return {k: v.replace("/etc/pagedserve/tls", str(secrets / service)) for k, v in env.items()}


def _probe(address: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pagedserve.cli", "probe", address, *flags]
    return subprocess.run(command, env=os.environ | env, capture_output=True, text=True)


def test_the_services_serve_text_over_mutual_tls_with_the_compose_environment(
    redis_server: int, secrets: Path, tiny_chat_model_dir: Path
) -> None:
    """The executor registers by IP; the scheduler checks its certificate for `executor`."""
    executor_env = _environment("executor", secrets, redis_server)
    port, scheduler_port = free_port(), free_port()
    args = ["executor", "--port", str(port), "--model", str(tiny_chat_model_dir)]
    args += ["--num-gpu-blocks", "64", "--swap-space", "0.05", "--metrics-port", "0"]
    procs = [start(args, f"deploy-executor-{port}.log", executor_env)]
    try:
        deadline = time.monotonic() + 180
        while _probe(f"127.0.0.1:{port}", executor_env).returncode != 0:  # the health check
            assert procs[0].poll() is None and time.monotonic() < deadline, "executor not up"
            time.sleep(1)
        args = ["scheduler", "--port", str(scheduler_port)]
        env = _environment("scheduler", secrets, redis_server)
        procs.append(start(args, f"deploy-scheduler-{scheduler_port}.log", env))
        base = f"http://127.0.0.1:{scheduler_port}"
        wait_healthy(base, procs[1])
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        serving = _probe(f"127.0.0.1:{port}", executor_env, "--serving")  # the readiness probe
        assert serving.returncode == 0, serving.stderr
    finally:
        for proc in reversed(procs):
            stop(proc)
