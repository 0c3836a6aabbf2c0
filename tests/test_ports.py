"""The test suite's ports: each xdist worker chooses from a slice of its own, so a port one
worker chose and has not bound yet is never another's choice."""

from __future__ import annotations

import pytest

from tests import services


def test_each_worker_chooses_its_ports_from_its_own_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    chosen = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        chosen[worker] = {services.free_port() for _ in range(20)}
    low, high = services._worker_range(10_000, services._ephemeral_start())
    assert all(low <= port < high for port in chosen["gw1"])
    assert max(chosen["gw0"]) < low  # gw0's slice lies below gw1's
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert services._worker_range(10_000, 30_000) == (10_000, 30_000)  # alone: all of it
