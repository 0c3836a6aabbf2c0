"""A private redis-server for tests that kill, pause or restart it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.services import free_port


class RedisServer:
    """redis-server on a free port with its append-only file in ``data_dir``; it can be
    killed, paused and restarted on the same port and file, as an outage would."""

    def __init__(self, data_dir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no redis-server on PATH")
        self.binary, self.data_dir, self.port = binary, data_dir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.answers():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def answers(self) -> bool:
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
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
