"""Redis with an ACL user, and over TLS: an executor and a scheduler given only such a URL
(in the environment, out of the process list) register, lead, journal and stream through
it, every one of their connections as that user, and the password is in no log."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedserve.redis_url import check_redis_url, redacted
from tests.cluster import health, stream_text, wait_until
from tests.pki import CertificateAuthority
from tests.redis_server import RedisServer, server_binary
from tests.services import free_port, start, stop, wait_healthy

PASSWORD = "acl-secret-8e41"
# The default user is off: a connection that does not log in as `pagedserve` gets nothing.
ACL = ["--user", "default", "off", "--user", "pagedserve", "on", f">{PASSWORD}", "~*", "&*"]
ACL += ["+@all"]
USER_URL = f"pagedserve:{PASSWORD}@127.0.0.1:{{port}}/0"


def test_a_redis_url_is_checked_and_shown_without_its_password() -> None:
    check_redis_url(f"rediss://{USER_URL}")
    with pytest.raises(ValueError, match=r"redis:// or rediss://") as info:
        check_redis_url(f"http://{USER_URL}")
    assert PASSWORD not in str(info.value)
    assert redacted("rediss://u:p%40ss@h:6380/0?ssl_ca_certs=ca.pem") == (
        "rediss://u:***@h:6380/0?ssl_ca_certs=ca.pem"
    )
    assert redacted("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def _tls_server(data_dir: Path) -> RedisServer:
    """A Redis server that takes only TLS with client certificates of a test CA, and the
    ACL user; skips the test when no server binary here has TLS built in."""
    ca = CertificateAuthority(data_dir, "redis")
    (cert, key), (client_cert, client_key) = ca.issue("server"), ca.issue("client")
    args = [*ACL, "--port", "0", "--tls-port", "{port}", "--tls-cert-file", str(cert)]
    args += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca.ca_path)]
    query = f"?ssl_ca_certs={ca.ca_path}&ssl_certfile={client_cert}&ssl_keyfile={client_key}"
    binaries = dict.fromkeys(b for b in (server_binary(), shutil.which("redis-server")) if b)
    for binary in binaries:
        server = RedisServer(data_dir, False, args, f"rediss://{USER_URL}{query}", binary)
        try:
            server.start()
        except RuntimeError:
            continue  # built without TLS ("Failed finding TLS support")
        return server
    pytest.skip(f"no Redis server with TLS support among {list(binaries)}")


@pytest.fixture(params=["acl", "acl+tls"])
def secured_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    if request.param == "acl":
        server = RedisServer(tmp_path, append_only=False, args=ACL, url=f"redis://{USER_URL}")
        server.start()
    else:
        server = _tls_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_every_connection_logs_in_as_the_acl_user(secured_redis, tiny_chat_model_dir) -> None:
    """An executor and two scheduler replicas: the standby's stream is read from Redis."""
    url, namespace = secured_redis.url, f"sec-{uuid.uuid4().hex[:8]}"
    with pytest.raises(redis.RedisError):  # no user: refused
        redis.Redis.from_url(url.replace(f"pagedserve:{PASSWORD}@", "")).ping()
    env = {"PAGEDSERVE_STATE_STORE": url}
    port = free_port()
    args = ["executor", "--port", str(port), "--model", str(tiny_chat_model_dir)]
    args += ["--num-gpu-blocks", "64", "--swap-space", "0.05", "--metrics-port", "0"]
    procs = [start([*args, "--namespace", namespace], f"executor-acl-{port}.log", env)]
    try:
        urls = []
        for _ in range(2):
            scheduler_port = free_port()
            args = ["scheduler", "--port", str(scheduler_port), "--namespace", namespace]
            procs.append(start(args, f"scheduler-acl-{scheduler_port}.log", env))
            urls.append(f"http://127.0.0.1:{scheduler_port}")
        for base, proc in zip(urls, procs[1:], strict=True):
            wait_healthy(base, proc)
        wait_until(lambda: any(health(u)["executors"] for u in urls), 60, "a replica leads")
        for base in urls:  # journaled by the leader, streamed from Redis by the standby
            assert stream_text(base, "Once upon a time")
        with redis.Redis.from_url(url) as admin:
            clients = admin.client_list()
            assert admin.keys(f"{namespace}:*")  # the journal, the registry, the lease
        assert {c["user"] for c in clients} == {"pagedserve"}
        assert any(c["name"].startswith("listener:") for c in clients)  # event notices
        for proc in procs:
            assert PASSWORD not in proc.log_path.read_text()
    finally:
        for proc in reversed(procs):
            stop(proc)
