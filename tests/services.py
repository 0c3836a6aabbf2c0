"""Starting and stopping the real service processes for integration tests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

_handed_out: set[int] = set()
_ports = random.SystemRandom()  # not the global generator, which tests and plugins seed


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_range(low: int, high: int) -> tuple[int, int]:
    """This xdist worker's own slice of [low, high): two workers choose ports independently,
    and a port one chose may sit unbound for seconds while its server loads (a CI run once
    had the TLS front door's port taken that way)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (high - low) // count
    return low + int(worker) * width, low + (int(worker) + 1) * width


def free_port() -> int:
    """A loopback port nothing listens on, never the same twice in this process, and below
    the ephemeral range: a port the kernel handed out for a bind to port 0 could be handed out
    again, to the next caller or to a server's own outgoing connection, before the server that
    was given it binds (a CI run once gave a server's HTTP port and its executor's the same)."""
    low, high = _worker_range(10_000, _ephemeral_start())
    while True:
        port = _ports.randrange(low, high) if high - low > 1_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


GUARD_KEY = "guard-key"  # the API key of the guarded_server fixture (tests/scheduler_svc)


@contextlib.contextmanager
def serve(model_dir: Path, *flags: str, timeout: float = 180.0) -> Iterator[str]:
    """`pagedserve serve` in its own process group; yields the base URL once /health is ok."""
    with serving(model_dir, *flags, timeout=timeout) as proc:
        yield proc.url


@contextlib.contextmanager
def serving(model_dir: Path, *flags: str, timeout: float = 180.0) -> Iterator[subprocess.Popen]:
    """As ``serve``, yielding the process (its base URL in ``url``): for tests that hold
    its executor still (``executor_pid``)."""
    port, executor_port = free_port(), free_port()
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--executor-port",
        str(executor_port),
        "--swap-space",
        "0.05",
        *flags,
    ]
    proc = start(args, f"pagedserve-serve-{port}.log")
    proc.url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc.url, proc, timeout)
        yield proc
    finally:
        stop(proc)


def executor_pid(serve_proc: subprocess.Popen) -> int:
    """The pid of the executor a `pagedserve serve` process started (its only child)."""
    (child,) = Path(f"/proc/{serve_proc.pid}/task/{serve_proc.pid}/children").read_text().split()
    return int(child)


@contextlib.contextmanager
def held_still(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block, SIGCONT after it, also when the block fails."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def start(args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A `pagedserve` subcommand in its own process group, its output in a log file."""
    path = Path(tempfile.gettempdir()) / log_name
    with open(path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    proc.log_path = path
    return proc


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float = 180.0, verify: ssl.SSLContext | bool = True
) -> None:
    """Return once ``url`` answers /health (``verify``: how an https one is checked); a
    process that does not get there is stopped before the error is raised, so a failed
    start leaves nothing running."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = proc.log_path.read_text()[-3000:]
            raise RuntimeError(
                f"process exited {proc.returncode} before {url} was healthy:\n{tail}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200:
                return
        if time.monotonic() > deadline:
            stop(proc)
            raise TimeoutError(f"{url} not healthy after {timeout} s")
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
