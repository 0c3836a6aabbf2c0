"""A request arriving while the executor decodes many steps in a row ends that call after
its current step (EndSteps), on real processes: `pagedserve serve` with the tiny chat model,
256 decode steps a call and no quiet period. Outputs stay what they are alone."""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster import metric, used_blocks
from tests.services import free_port, serve

LONG = {"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
SHORT = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path):
    metrics_port = free_port()
    flags = ["--num-decode-steps", "256", "--decode-steps-quiet", "0", "--decode-steps-span", "0"]
    with serve(tiny_chat_model_dir, *flags, "--executor-metrics-port", str(metrics_port)) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model, f"http://127.0.0.1:{metrics_port}"


def stream_text(url: str, body: dict, started: threading.Event) -> str:
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                started.set()
    return "".join(text)


def complete(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def arrive_during(url: str, long_body: dict, short_bodies: list[dict]) -> tuple[str, list]:
    """Stream the long request while short ones arrive every 30 ms, whenever its calls
    start and end (on a fast machine its 900 tokens take under a second)."""
    started, result = threading.Event(), {}
    streamer = threading.Thread(
        target=lambda: result.update(text=stream_text(url, long_body, started))
    )
    streamer.start()
    sent = []  # (which short request, its future answer)
    try:
        assert started.wait(60)
        with ThreadPoolExecutor(8) as pool:
            for i in itertools.islice(itertools.cycle(range(len(short_bodies))), 40):
                if not streamer.is_alive():
                    break
                sent.append((i, pool.submit(complete, url, short_bodies[i])))
                time.sleep(0.03)
            answers = [(i, future.result()) for i, future in sent]
    finally:
        streamer.join(timeout=300)
    return result["text"], answers


def test_arrivals_end_calls_early_and_change_no_output(server):
    url, model, executor_metrics = server
    long_body = LONG | {"model": model}
    short_bodies = [SHORT | {"model": model, "prompt": f"Question {i}:"} for i in range(4)]
    alone = [complete(url, body) for body in [long_body, *short_bodies]]
    before = metric(executor_metrics, "executor_steps_ended_early_total")

    def ended() -> bool:
        return metric(executor_metrics, "executor_steps_ended_early_total") > before

    calls_before = metric(executor_metrics, "executor_step_seconds_count")
    rounds = []  # shorts sent each round
    # Whether an arrival lands inside a call of steps in a row is timing: a few rounds.
    while len(rounds) < 3 and not ended():
        text, answers = arrive_during(url, long_body, short_bodies)
        assert text == alone[0]
        assert [text for _, text in answers] == [alone[1 + i] for i, _ in answers]
        rounds.append(len(answers))
    calls = metric(executor_metrics, "executor_step_seconds_count") - calls_before
    assert ended(), f"short requests each round {rounds}, none ended a call early; {calls} calls"
    assert used_blocks(url) == 0


def test_a_newcomers_first_token_waits_for_no_steps_in_a_row(server):
    """The call that admits a newcomer decodes one step: slots mapped for steps that calls
    ended early did not run go to later calls. Before, that call ran them all (up to 2 x 256
    steps here), and the newcomer's first token with them. Counted in the long stream's
    tokens that reached it while a newcomer waited, not timed."""
    url, model, _ = server
    tokens: list[tuple[float, int]] = []  # (arrival, tokens) of each of the long's events
    started = threading.Event()

    def follow() -> None:
        body = LONG | {"model": model, "stream": True, "logprobs": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    num = len((choice.get("logprobs") or {}).get("tokens") or [])
                    tokens.append((time.perf_counter(), num))
                    started.set()

    streamer = threading.Thread(target=follow)
    streamer.start()
    waits = []  # the long stream's tokens while each newcomer waited for its first
    try:
        assert started.wait(60)
        for i in range(4):
            time.sleep(0.2)  # calls of 256 steps in a row run meanwhile
            body = SHORT | {"model": model, "prompt": f"Newcomer {i}:", "max_tokens": 1}
            sent = time.perf_counter()
            complete(url, body)
            first = time.perf_counter()
            during = [n for at, n in tokens if sent < at <= first]
            # The first of them is the call the newcomer ended: drawn before it was sent.
            waits.append(sum(during[1:]))
    finally:
        streamer.join(timeout=300)
    assert len(tokens) > 1 and max(waits) < 64, waits
