"""Stopping `pagedserve serve` while streams run, as users do: Ctrl-C in its terminal (SIGINT
to the whole process group, its executor child included) and `docker stop` or `kill`
(SIGTERM to the process alone). Real processes, the real tiny model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.services import serving

NUM_STREAMS = 3


def open_streams(url: str, max_tokens: int) -> tuple[list[threading.Thread], list[list[dict]]]:
    """Start NUM_STREAMS streaming completions; returns their threads and, per stream, its
    events as parsed JSON (``"[DONE]"`` kept as is), filled in as they come."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    events: list[list[dict]] = [[] for _ in range(NUM_STREAMS)]

    def read(into: list) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    into.append(data if data == "[DONE]" else json.loads(data))

    threads = [threading.Thread(target=read, args=(e,), daemon=True) for e in events]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not all(events) and time.monotonic() < deadline:  # every stream has a token
        time.sleep(0.05)
    assert all(events), "a stream got no token"
    return threads, events


def stop_while_streaming(
    model_dir: Path,
    max_tokens: int,
    kill: Callable[[int, int], None],
    sig: int,
    within_s: float,
) -> list[list[dict]]:
    """Serve, start the streams, send ``sig`` by ``kill`` (os.kill: to the server alone,
    os.killpg: to its process group); returns the streams' events once the server exited 0
    within ``within_s``, its executor with it."""
    with serving(model_dir) as proc:
        threads, events = open_streams(proc.url, max_tokens)
        kill(proc.pid, sig)
        proc.wait(timeout=within_s)
        for thread in threads:
            thread.join(timeout=10)
        assert proc.returncode == 0
        with pytest.raises(ProcessLookupError):  # nothing is left of its process group
            os.killpg(proc.pid, 0)
    return events


def test_ctrl_c_stops_both_processes_and_ends_every_stream_with_an_error(
    tiny_chat_model_dir: Path,
) -> None:
    """The executor stops at once under the group's signal; the scheduler used to wait for
    it forever, with its streams open (uvicorn waits for them before the engine stops)."""
    for stream in stop_while_streaming(
        tiny_chat_model_dir, 1000, os.killpg, signal.SIGINT, within_s=20
    ):
        errors = [e for e in stream if isinstance(e, dict) and "error" in e]
        assert [e["error"]["code"] for e in errors] == ["engine_unavailable"], stream[-2:]
        assert "executor is gone" in errors[0]["error"]["message"]


def test_sigterm_to_the_server_alone_lets_its_streams_finish(tiny_chat_model_dir: Path) -> None:
    """`docker stop` signals the server, not its executor: the streams in flight finish."""
    for stream in stop_while_streaming(
        tiny_chat_model_dir, 200, os.kill, signal.SIGTERM, within_s=30
    ):
        assert stream[-1] == "[DONE]"
        chunks = [e for e in stream if isinstance(e, dict)]
        assert all("error" not in e for e in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
