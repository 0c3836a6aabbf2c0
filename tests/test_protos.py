"""The committed gRPC stubs in pagedserve/rpc/v1 are what proto/ generates today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "pagedserve" / "rpc" / "v1"


def _stubs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.glob("*_pb2*.py*")}


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _stubs(tmp_path / "pagedserve" / "rpc" / "v1")
    committed = _stubs(STUBS)
    assert fresh, "gen_protos.py generated nothing"
    stale = sorted(
        name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name)
    )
    assert not stale, f"stale stubs {stale}: run python scripts/gen_protos.py and commit them"


def test_stubs_import_and_name_every_service() -> None:
    from pagedserve.rpc.v1 import executor_pb2, executor_pb2_grpc, frontdoor_pb2, frontdoor_pb2_grpc

    services = {
        (executor_pb2, "Executor", executor_pb2_grpc.ExecutorStub): {
            "InitCache",
            "Execute",
            "EndSteps",
            "CopyBlocks",
            "SwapBlocks",
            "GetStats",
            "Fence",
        },
        (frontdoor_pb2, "FrontDoor", frontdoor_pb2_grpc.FrontDoorStub): {"Generate", "Abort"},
    }
    with grpc.insecure_channel("127.0.0.1:1") as channel:  # connects only on a call
        for (module, service, stub_class), methods in services.items():
            assert set(module.DESCRIPTOR.services_by_name[service].methods_by_name) == methods
            stub = stub_class(channel)
            assert all(callable(getattr(stub, method, None)) for method in methods), service
