"""Admission rules of a modern engine, on real processes (`pagedserve serve`, the tiny chat
model): a bounded waiting queue (429 with Retry-After beyond --max-waiting-requests, or
when at the rate the queue drains a new one would wait past --max-queue-wait; counted, and
every admitted request still gets its whole answer), priorities (lower first), and
deadlines (a request past its timeout ends with deadline_exceeded and frees its blocks)."""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from scheduler_svc.engine.admission import RATE_STARTS, RATE_WINDOW_S, Admission, AdmissionLimits
from scheduler_svc.state.streams import QueueFullError
from tests.cluster import metric, used_blocks
from tests.openai_spec import assert_conforms
from tests.services import executor_pid, held_still, serve, serving

MAX_TOKENS = 200  # long enough that the burst lands while the first ones run
BURST = 12
WAITING_TOKENS = 64  # of each request queued behind a long one (priority test)


@pytest.fixture(scope="module")
def served(tiny_chat_model_dir: Path):
    # One sequence runs at a time, so a burst waits; at most 3 may wait.
    flags = ["--num-gpu-blocks", "64", "--max-num-seqs", "1", "--max-waiting-requests", "3"]
    with serving(tiny_chat_model_dir, *flags, "--executor-metrics-port", "0") as proc:
        yield proc


@pytest.fixture(scope="module")
def server(served) -> tuple[str, str]:
    return served.url, httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def impatient_server(tiny_chat_model_dir: Path):
    """One sequence at a time, and a wait bound no queue behind it can meet."""
    flags = ["--num-gpu-blocks", "64", "--max-num-seqs", "1", "--max-queue-wait", "0.01"]
    with serve(tiny_chat_model_dir, *flags) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_bound_follows_the_rate_requests_leave_the_queue():
    clock = Clock()
    admission = Admission(AdmissionLimits(requests=100, tokens=10_000, wait_s=10), clock)
    admission.check(50, 500, 10)  # no rate known yet: only the counts bound the queue
    for _ in range(2 * RATE_STARTS):  # two first events a second
        clock.now += 0.5
        admission.started()
    assert admission.drain_rate() == pytest.approx(2, rel=0.1)
    admission.check(18, 500, 10)  # the 19th in the queue waits about 9.5 s
    with pytest.raises(QueueFullError, match="would wait about") as refused:
        admission.check(20, 500, 10)  # the 21st about 10.5 s
    assert refused.value.reason == "queue_wait"
    admission.check(0, 0, 10)  # an empty queue admits whatever the rate
    for _ in range(RATE_STARTS):  # then one first event every 2 s: the last few rule
        clock.now += 2
        admission.started()
    assert admission.drain_rate() == pytest.approx(0.5, rel=0.1)
    admission.check(3, 500, 10)  # the 4th waits about 8 s
    with pytest.raises(QueueFullError, match="would wait about"):
        admission.check(5, 500, 10)  # the 6th about 12 s
    clock.now += RATE_WINDOW_S + 1  # the first events age out of the window: no rate again
    assert admission.drain_rate() is None
    admission.check(99, 500, 10)
    with pytest.raises(QueueFullError) as full:
        admission.check(100, 500, 10)
    assert full.value.reason == "queue_full"
    unbounded = Admission(AdmissionLimits(wait_s=0), clock)
    for _ in range(RATE_STARTS):
        clock.now += 10
        unbounded.started()
    unbounded.check(1000 - 1, 0, 10)


def test_a_burst_after_a_steady_spell_is_judged_by_the_pace_while_requests_wait():
    """Requests that started together, then seconds with nobody waiting: the queue was
    not slow, it was empty. A burst then is admitted, and judged again once it waits."""
    clock = Clock()
    admission = Admission(AdmissionLimits(requests=1000, tokens=100_000, wait_s=60), clock)
    for _ in range(RATE_STARTS):  # a level of requests starting in one step
        clock.now += 0.01
        admission.started()
    clock.now += 8  # they run; nobody waits
    for waiting in range(56):  # a burst arrives at once
        admission.check(waiting, 64 * waiting, 64)
    assert admission.drain_rate() > 40
    clock.now += 10  # none of it started: the queue is as slow as it looks now
    assert admission.drain_rate() < 1
    with pytest.raises(QueueFullError, match="would wait about"):
        admission.check(56, 64 * 56, 64)


def test_past_the_wait_bound_a_burst_gets_429_and_the_admitted_finish(impatient_server):
    url, model = impatient_server
    for i in range(RATE_STARTS):  # a drain rate to judge by
        assert complete(url, model, i, max_tokens=4).status_code == 200
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda i: complete(url, model, i), range(BURST)))
    full = [r for r in answers if r.status_code == 429]
    assert full and all(r.status_code in (200, 429) for r in answers)
    for r in full:
        assert r.headers["retry-after"] == "2"
        assert "would wait about" in r.json()["error"]["message"]
    for r in answers:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    text = httpx.get(f"{url}/metrics").text
    assert f'pagedserve_requests_refused_total{{reason="queue_wait"}} {len(full)}.0' in text


def refused(url: str) -> float:
    return metric(url, "requests_refused_total")


def aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(
        re.search(r'^pagedserve_requests_total\{finish_reason="abort"\} (\S+)$', text, re.M)[1]
    )


def complete(url: str, model: str, i: int, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"model": model, "prompt": f"Story {i}:", "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def test_a_burst_beyond_the_queue_gets_429_and_the_admitted_finish(server):
    url, model = server
    before = refused(url)
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda i: complete(url, model, i), range(BURST)))
    ok = [r for r in answers if r.status_code == 200]
    full = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(full) == BURST, [r.status_code for r in answers]
    assert ok and full
    for r in full:
        assert r.headers["retry-after"] == "2"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert_conforms("ErrorResponse", r.json())
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert refused(url) - before == len(full)
    assert complete(url, model, 99).status_code == 200  # room again once they finished


def test_the_openai_client_sees_a_rate_limit_error(server):
    url, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with ThreadPoolExecutor(BURST) as pool:
        results = list(
            pool.map(
                lambda i: _call(client, model, i),
                range(BURST),
            )
        )
    assert any(isinstance(r, openai.RateLimitError) for r in results)
    assert all(isinstance(r, openai.RateLimitError | str) for r in results), results


def _call(client: openai.OpenAI, model: str, i: int) -> str | Exception:
    try:
        return (
            client.completions.create(
                model=model, prompt=f"Tale {i}:", max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
        )
    except openai.APIError as e:
        return e


def test_a_lower_priority_value_runs_first(server, served):
    """One sequence runs at a time: of the requests waiting behind a long one, the urgent
    one that came last finishes before the two that came before it. The executor is held
    still while they arrive, so the long one surely runs on meanwhile, and the order is the
    engine's, read from its log (stamped by the client's threads, a loaded machine once ran
    the urgent one's thread late enough to invert it)."""
    url, model = server
    ids = {name: f"{name}-{uuid.uuid4().hex}" for name in ("later0", "later1", "urgent")}

    def run(name: str, priority: int) -> None:
        body = {"model": model, "prompt": f"{name}:", "priority": priority, "ignore_eos": True}
        body |= {"max_tokens": WAITING_TOKENS, "temperature": 0}
        headers = {"X-Request-Id": ids[name]}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text

    long = {"model": model, "prompt": "Long:", "max_tokens": 1000, "ignore_eos": True}
    with (
        ThreadPoolExecutor(3) as pool,
        httpx.stream("POST", f"{url}/v1/completions", json=long | {"stream": True}) as first,
    ):
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # it runs
        with held_still(executor_pid(served)):
            later = [pool.submit(run, f"later{i}", 10) for i in range(2)]
            time.sleep(0.3)
            urgent = pool.submit(run, "urgent", -5)
            time.sleep(1.0)  # the three are queued: nothing can run until the long one ends
            assert not any(f.done() for f in [*later, urgent])
        for _ in lines:  # read the long one to its end; then the others run
            pass
        for future in [*later, urgent]:
            future.result()
    order = finish_order(served.log_path, set(ids.values()))
    assert order.index(ids["urgent"]) < min(order.index(ids["later0"]), order.index(ids["later1"]))


def finish_order(log: Path, request_ids: set[str]) -> list[str]:
    """``request_ids`` in the order the engine finished them (the "request finished" lines
    of the server's log, one a request, in step order)."""
    finished = [
        json.loads(line)["request_id"]
        for line in log.read_text().splitlines()
        if '"request finished"' in line
    ]
    return [request_id for request_id in finished if request_id in request_ids]


def test_a_request_past_its_timeout_ends_with_deadline_exceeded(server):
    url, model = server
    body = {"model": model, "prompt": "Go on:", "max_tokens": 1000, "ignore_eos": True}
    before = aborts(url)
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body | {"timeout": 0.5}, timeout=60)
    assert r.status_code == 504 and time.monotonic() - start < 10
    assert r.json()["error"]["code"] == "deadline_exceeded"
    headers = {"X-Request-Timeout": "0.5"}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=headers, timeout=60
    ) as s:
        assert s.status_code == 200
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "deadline_exceeded"
    assert len(data) < 1000  # ended early, not after its 1000 tokens
    assert aborts(url) - before == 2
    assert used_blocks(url) == 0
    bad = httpx.post(f"{url}/v1/completions", json=body | {"timeout": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    assert complete(url, model, 7).status_code == 200
