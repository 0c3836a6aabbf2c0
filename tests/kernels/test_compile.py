"""The CUDA sources compile with nvcc for sm_80, sm_90 and sm_100, the executor image's
targets (compile only: no GPU needed). Without a CUDA toolkit, the nvcc the dev extras
install from PyPI (nvidia-cuda-nvcc) does it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parents[2] / "pagedserve_kernels" / "csrc"
SOURCES = [*sorted(CSRC.glob("*.cu")), CSRC / "bindings.cpp"]
ARCHS = ("80", "90", "100")


def _find_nvcc() -> str | None:
    """nvcc on PATH, in the usual toolkit place, or from the nvidia-cuda-nvcc wheel."""
    candidates = [Path("/usr/local/cuda/bin/nvcc")]
    nvidia = importlib.util.find_spec("nvidia")
    for root in nvidia.submodule_search_locations if nvidia else ():
        candidates += sorted(Path(root).glob("cu*/bin/nvcc"))
    return shutil.which("nvcc") or next((str(p) for p in candidates if p.exists()), None)


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None,
    reason="no nvcc on PATH, in /usr/local/cuda/bin or from the nvidia-cuda-nvcc wheel",
)


def _flags(shim: Path) -> list[str]:
    """The flags torch.utils.cpp_extension.load would add, for both archs."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(shim)]
    flags = ["--std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-O3"]
    flags += ["-DTORCH_EXTENSION_NAME=pagedserve_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    flags += list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", []))  # no implicit half casts
    for arch in ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags + [f"-I{path}" for path in includes]


def _shim_headers(root: Path) -> Path:
    """CPU wheels of torch ship c10/cuda headers without the one CMake generates; stand it in.

    It sits last on the include path, so a CUDA build of torch uses its own.
    """
    header = root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True)
    header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return root


def _compile(source: Path, out_dir: Path, flags: list[str]) -> subprocess.CompletedProcess[str]:
    assert NVCC is not None
    cmd = [NVCC, "-c", "-o", str(out_dir / f"{source.name}.o"), *flags, str(source)]
    if source.suffix == ".cpp":  # host code only: parse and type-check, skip code generation
        cmd += ["-Xcompiler", "-fsyntax-only", "-Xcompiler", "-Wno-c++20-extensions"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every source compiled once, in parallel (the bindings parse all of torch's headers)."""
    out_dir = tmp_path_factory.mktemp("nvcc")
    flags = _flags(_shim_headers(out_dir / "shim"))
    workers = max(1, min(len(SOURCES), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda source: _compile(source, out_dir, flags), SOURCES)
        return {source.name: done for source, done in zip(SOURCES, results, strict=True)}


def test_every_cu_file_is_covered() -> None:
    assert {p.name for p in SOURCES} >= {"paged_attention.cu", "cache_kernels.cu", "bindings.cpp"}


@pytest.mark.parametrize("name", [p.name for p in SOURCES])
def test_source_compiles(compiled: dict[str, subprocess.CompletedProcess], name: str) -> None:
    done = compiled[name]
    assert done.returncode == 0, f"nvcc failed on {name}:\n{done.stderr[-4000:]}"
