"""The fault suite's own check: a short run of a real scenario on real processes loses no
request, gives no wrong text and leaks no block, and its proxy injects what it says."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from bench import faults
from bench.fault_proxy import FaultProxy
from bench.fault_soak import rss_summary

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


def test_the_soak_compares_medians_of_the_first_and_last_samples() -> None:
    """One sample's spike (a warm-up peak, a collection) moves neither figure."""
    series = [400.0, 520.0, 410.0, 405.0, 415.0, 600.0, 420.0, 418.0]
    samples = [{"t_s": 30.0 * i, "mib": {"executor": mib}} for i, mib in enumerate(series)]
    assert rss_summary(samples) == {
        "executor": {"start": 410.0, "end": 420.0, "min": 400.0, "max": 600.0, "change_pct": 2.4}
    }
