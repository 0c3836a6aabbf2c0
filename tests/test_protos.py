"""The committed gRPC stubs in pagedserve/rpc/v1 are what proto/ generates today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

    assert set(executor_pb2.DESCRIPTOR.services_by_name["Executor"].methods_by_name) == {
        "InitCache",
        "Execute",
        "CopyBlocks",
        "SwapBlocks",
        "GetStats",
    }
    assert set(frontdoor_pb2.DESCRIPTOR.services_by_name["FrontDoor"].methods_by_name) == {
        "Generate",
        "Abort",
    }
    assert executor_pb2_grpc.ExecutorStub and frontdoor_pb2_grpc.FrontDoorStub
