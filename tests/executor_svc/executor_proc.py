"""An executor service as a real process on a free loopback port, for the server tests."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorUnavailable
from tests.services import free_port

NUM_GPU_BLOCKS = 64
SWAP_GIB = 0.01
START_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    client: ExecutorClient
    log_path: Path
    epochs: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    def next_epoch(self) -> int:
        """Each test acts as a new scheduler: a newer epoch, step ids from anywhere."""
        return next(self.epochs)


def start_executor(model_dir: Path, log_path: Path, num_gpu_blocks: int = NUM_GPU_BLOCKS) -> Server:
    """Start an executor process and wait until its health service answers; a port taken
    between choosing and binding it is retried."""
    for _ in range(3):
        server = _try_start(model_dir, log_path, free_port(), num_gpu_blocks)
        if server is not None:
            return server
    pytest.fail(f"no free port after 3 tries:\n{log_path.read_text()}")


def _try_start(model_dir: Path, log_path: Path, port: int, num_gpu_blocks: int) -> Server | None:
    cmd = [sys.executable, "-m", "pagedserve.cli", "executor", "--port", str(port)]
    cmd += ["--model", str(model_dir), "--num-gpu-blocks", str(num_gpu_blocks)]
    cmd += ["--swap-space", str(SWAP_GIB), "--device", "cpu"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, ExecutorClient(f"127.0.0.1:{port}", execute_timeout=30), log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "cannot listen" in log_path.read_text():
                return None
            pytest.fail(f"executor exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            server.client.health(timeout=1.0)
            return server
        except ExecutorUnavailable:
            time.sleep(0.1)
    stop_executor(server)
    pytest.fail(f"executor did not answer in {START_TIMEOUT_S} s:\n{log_path.read_text()}")


def stop_executor(server: Server) -> None:
    server.client.close()
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)
