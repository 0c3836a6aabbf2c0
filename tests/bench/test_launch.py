"""A benchmark stopped by SIGTERM (a `timeout`, a CI runner) stops the servers it started,
as Ctrl-C does: a real child process in its own group, a real signal."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from bench.common import ROOT

HOLDS_A_SLEEPER = """
import time
from bench.launch import process
with process(["sleep", "300"], "sleeper", lambda: True) as proc:
    print(proc.pid, flush=True)
    time.sleep(300)
"""


def test_sigterm_stops_what_the_benchmark_started() -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", HOLDS_A_SLEEPER], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    sleeper = int(bench.stdout.readline())
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(sleeper), "the benchmark's server outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sleeper, signal.SIGKILL)
        bench.kill()
        bench.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
