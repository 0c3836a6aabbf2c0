"""Regenerate the committed gRPC stubs in pagedserve/rpc/v1 from proto/ (grpcio-tools)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "pagedserve" / "rpc" / "v1"


def generate(out_dir: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir``.

    The proto path mirrors the Python package, so the stubs land in
    ``out_dir/pagedserve/rpc/v1`` and their imports need no rewriting.
    """
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {PROTO_DIR}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT.relative_to(ROOT)}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    args = parser.parse_args()
    import os

    os.chdir(ROOT)  # protoc resolves the relative proto paths from the repo root
    generate(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
