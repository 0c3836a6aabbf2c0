"""Redis killed and restarted on its append-only file, or paused, mid-generation: the
engine resumes by itself and every stream finishes byte-identical to an undisturbed run.
A stored request that cannot be run or restored is dropped with an error, never replayed
into a crash. Real processes: a private redis-server, executor, scheduler."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scheduler_svc.state.redis_store import RedisStateStore
from tests.cluster import (
    MAX_TOKENS,
    body,
    metric,
    reference_texts,
    start_executor,
    start_scheduler,
    stream_text,
    used_blocks,
    wait_executors,
    wait_until,
)
from tests.redis_server import RedisServer
from tests.services import stop

pytestmark = pytest.mark.redis
PROMPTS = [f"Entry {i}: the storm passed the island and" for i in range(4)]
STORE_BUDGET_S = 30
SHORT_BUDGET_S = 3
OUTAGE_TOKENS = 192  # long enough that no stream can finish before the fault strikes


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS)


@pytest.fixture(scope="module")
def long_reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS, max_tokens=OUTAGE_TOKENS)


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def deployment(tiny_chat_model_dir: Path, redis_server: RedisServer):
    """An executor and a scheduler on the private Redis; yields (url, namespace, procs).
    Streams wait out an outage of up to STORE_BUDGET_S."""
    namespace = f"test-outage-{uuid.uuid4().hex}"
    executor, _ = start_executor(tiny_chat_model_dir, namespace, redis=redis_server.url)
    budget = ("--store-budget", str(STORE_BUDGET_S))
    scheduler, url = start_scheduler(namespace, *budget, redis=redis_server.url)
    procs = {"executor": executor, "scheduler": scheduler}
    try:
        wait_executors(url, 1)
        yield url, namespace, procs
    finally:
        for proc in procs.values():
            stop(proc)


def stream_during(url: str, fault) -> list[str]:
    """The streams of PROMPTS, with ``fault()`` run once every one is in the engine and
    generation is under way (a request sent during the outage is refused, rightly). Should
    a stream finish first anyway (a very slow machine), the fault strikes the rest."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        before = metric(url, "generation_tokens_total")
        texts = [pool.submit(stream_text, url, p, OUTAGE_TOKENS) for p in PROMPTS]

        def under_way() -> bool:
            if metric(url, "generation_tokens_total") <= before + 12:
                return False
            all_in = metric(url, "num_requests") >= len(PROMPTS)
            return all_in or any(t.done() for t in texts)

        wait_until(under_way, 60, "every stream under way")
        fault()
        return [t.result() for t in texts]


@pytest.mark.parametrize("outage", ["kill-9-and-restart", "pause-8s"])
def test_the_engine_rides_out_a_redis_outage(
    deployment, redis_server, reference, long_reference, outage
):
    url, _, _ = deployment
    finished_before = metric(url, "requests_total")

    def fault() -> None:
        if outage == "pause-8s":  # past the lease's 3 s: the leader steps down and back
            redis_server.pause()
            time.sleep(8)
            redis_server.resume()
        else:
            redis_server.kill()
            time.sleep(3)
            redis_server.start()

    assert stream_during(url, fault) == [long_reference[p] for p in PROMPTS]

    # A stream that follows the store after a step-down ends as soon as the last commit
    # lands; the engine counts the request when its step returns, an instant later.
    def counted() -> float:
        return metric(url, "requests_total") - finished_before

    wait_until(lambda: counted() >= len(PROMPTS), 10, "every request counted")
    assert counted() == len(PROMPTS)
    assert stream_text(url, PROMPTS[0]) == reference[PROMPTS[0]]  # no restart by hand
    wait_until(lambda: used_blocks(url) == 0, 10, "blocks freed")


def test_a_redis_restarted_empty_is_led_past_the_executors_epoch(
    deployment, redis_server, reference
):
    """The journal and the epoch are gone, the executor still remembers the newest epoch
    it ran: the leader takes one past it (each new term's epoch counts from 1 again, which
    the executor would refuse as stale), and new requests are served on the same
    processes. Requests in flight have lost their records: each ends, never hangs."""
    url, _, procs = deployment
    assert stream_text(url, PROMPTS[0]) == reference[PROMPTS[0]]  # the executor saw epochs

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # Long enough to be in flight when polled; should one finish first anyway (it once
        # did, all four between two polls), the restart strikes the rest.
        in_flight = [pool.submit(complete_status, url, p, OUTAGE_TOKENS) for p in PROMPTS]

        def in_engine() -> bool:
            return metric(url, "num_requests") >= 1 or any(f.done() for f in in_flight)

        wait_until(in_engine, 60, "a request in the engine")
        redis_server.restart_empty()
        assert all(isinstance(f.result(timeout=180), int) for f in in_flight)
    wait_executors(url, 1)
    wait_until(lambda: complete_status(url, PROMPTS[1]) == 200, 60, "served again")
    assert stream_text(url, PROMPTS[1]) == reference[PROMPTS[1]]
    assert all(proc.poll() is None for proc in procs.values())


def complete_status(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> int:
    request = body(url, prompt, max_tokens=max_tokens)
    return httpx.post(f"{url}/v1/completions", json=request, timeout=120).status_code


def test_past_its_budget_a_stream_ends_with_an_error_and_resumes(
    deployment, redis_server, tiny_chat_model_dir
):
    """A pause longer than the stream's budget: the stream ends with an error event the
    client can act on (503, store_unavailable), the request goes on, and a resume with
    Last-Event-ID once Redis is back gets the rest of the text."""
    url, namespace, procs = deployment
    stop(procs.pop("scheduler"))
    budget = ("--store-budget", str(SHORT_BUDGET_S))
    procs["scheduler"], url = start_scheduler(namespace, *budget, redis=redis_server.url)
    prompt = PROMPTS[0]
    # Far more tokens than the client reads before it pauses Redis: a client reading late on
    # a loaded machine must not find the whole stream generated and committed by then.
    request = body(url, prompt, stream=True) | {"max_tokens": OUTAGE_TOKENS * 3}
    expected = reference_texts(tiny_chat_model_dir, [prompt], max_tokens=OUTAGE_TOKENS * 3)[prompt]
    text, last_id, error, paused = "", None, None, False
    resumable = {"X-Resumable-Stream": "true"}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=request, headers=resumable, timeout=120
    ) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                text += chunk["choices"][0]["text"]
                if len(text) > 20 and not paused:
                    redis_server.pause()
                    paused = True
    redis_server.resume()
    assert error is not None and error["code"] == "store_unavailable", error
    headers = {"X-Request-Id": request_id, "Last-Event-ID": last_id}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=request, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == expected


def test_a_request_that_cannot_be_journaled_is_dropped_alone(
    deployment, redis_server, reference, tiny_chat_model_dir
):
    """A submitted record that passed no front door (a lone surrogate in a stop string):
    its stream ends with an error event, the others finish, and a restarted scheduler
    serves on."""
    url, namespace, procs = deployment
    store = RedisStateStore(redis_server.url, namespace)
    record = {
        "prompt": [1, 2, 3],
        "params": {"max_tokens": 8, "stop": ["a\ud800b"]},
        "arrival": time.time(),
    }
    with ThreadPoolExecutor(1) as pool:
        texts = pool.submit(lambda: [stream_text(url, p) for p in PROMPTS[:2]])
        assert store.submit_request("poison", json.dumps(record))
        assert texts.result() == [reference[p] for p in PROMPTS[:2]]
    wait_until(lambda: store.read_events("poison"), 30, "the poison's event")
    (_, event), *_ = store.read_events("poison")
    assert "cannot be journaled" in json.loads(event)["error"]
    assert store.pending_requests() == []
    stop(procs.pop("scheduler"))
    procs["scheduler"], url = start_scheduler(namespace, redis=redis_server.url)
    assert stream_text(url, PROMPTS[2]) == reference[PROMPTS[2]]


def test_recovery_quarantines_a_stored_group_that_does_not_restore(
    deployment, redis_server, reference
):
    """A corrupt group in the journal: the restarted scheduler drops it with an error
    event and recovers the rest."""
    url, namespace, procs = deployment
    stop(procs.pop("scheduler"))
    store = RedisStateStore(redis_server.url, namespace)
    lanes = store.lane_names()
    view = store.lane(lanes[0]) if lanes else store
    view._redis.hset(view._lane_key("groups"), "corrupt", '{"version": 1, "seqs": [')
    procs["scheduler"], url = start_scheduler(namespace, redis=redis_server.url)
    wait_until(lambda: store.read_events("corrupt"), 30, "the quarantine's event")
    (_, event), *_ = store.read_events("corrupt")
    assert "could not be recovered" in json.loads(event)["error"]
    assert "corrupt" not in view._redis.hgetall(view._lane_key("groups"))
    response = httpx.get(f"{url}/health", timeout=5)
    assert response.status_code == 200, response.text
    assert stream_text(url, PROMPTS[0]) == reference[PROMPTS[0]]
