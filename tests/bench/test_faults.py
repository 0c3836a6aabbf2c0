"""The fault suite's own check: a short run of a real scenario on real processes loses no
request, gives no wrong text and leaks no block, and its proxy injects what it says."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from bench import faults
from bench.fault_proxy import FaultProxy

pytestmark = pytest.mark.redis


def test_a_redis_kill_loses_nothing(tmp_path: Path, tiny_chat_model_dir: Path) -> None:
    out = tmp_path / "faults.json"
    flags = ["--scenarios=redis-kill", "--schedulers=1", "--concurrency=4", "--duration=4"]
    flags += ["--fault-at=2", "--num-specs=4", "--max-tokens=12", f"--json={out}"]
    args = faults.parse_args(flags)
    args.model_dir = tiny_chat_model_dir
    rows = faults.run(args)
    assert [r.scenario for r in rows] == ["no fault", "redis kill -9, AOF restart"]
    for row in rows:
        assert row.sent > 0 and row.ok, row
        assert row.correct + row.failed_clearly == row.sent, row
    assert len(json.loads(out.read_text())["rows"]) == 2


def test_the_proxy_forwards_stalls_and_resets() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        proxy = FaultProxy("127.0.0.1", server.getsockname()[1])
        proxy.start()
        try:
            client = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
            peer, _ = server.accept()
            client.sendall(b"ping")
            assert peer.recv(4) == b"ping"
            proxy.stall(True)
            client.sendall(b"held")
            peer.settimeout(0.5)
            with pytest.raises(TimeoutError):
                peer.recv(4)
            proxy.stall(False)
            peer.settimeout(5)
            assert peer.recv(4) == b"held"
            proxy.reset()
            with pytest.raises(ConnectionResetError):
                client.recv(1)
        finally:
            proxy.close()
