"""An executor is given up only on evidence, and a false alarm never corrupts state: an
executor paused past its heartbeat, one killed and restarted at its address (alone, or
beside another that takes its requests meanwhile), and a burst of requests. Real
processes: registered executors, a scheduler, redis-server; greedy text is compared with an
uninterrupted offline run, and each request must finish exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster import (
    MAX_TOKENS,
    body,
    metric,
    num_steps,
    reference_texts,
    start_executor,
    start_scheduler,
    stream_text,
    used_blocks,
    wait_executors,
    wait_until,
)
from tests.services import stop

pytestmark = pytest.mark.redis
PROMPTS = [f"Log {i}: the lighthouse keeper wrote that the ships" for i in range(4)]
# Tokens of the requests an executor is paused under: enough that its share is still
# running when the pause begins, however loaded the machine (at 48 a request could end
# first, leaving no step on the wire to prove the executor alive).
PAUSED_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS)


@pytest.fixture(scope="module")
def long_reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS, PAUSED_MAX_TOKENS)


@pytest.fixture
def namespace() -> str:
    return f"test-liveness-{uuid.uuid4().hex}"


def stream_all(url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: stream_text(url, p, max_tokens), prompts))


def wait_generating(address: str, steps: int = 3) -> None:
    start = num_steps(address)
    wait_until(lambda: num_steps(address) >= start + steps, 60, f"{address} steps")


def test_an_executor_paused_past_its_heartbeat_keeps_its_requests(
    tiny_chat_model_dir, namespace, redis_url, long_reference
):
    """SIGSTOP for three heartbeat TTLs while its steps are in flight: the step on the
    wire proves it alive, so nothing moves, and every request finishes once."""
    executors = [start_executor(tiny_chat_model_dir, namespace, redis=redis_url) for _ in range(2)]
    scheduler, url = start_scheduler(namespace, redis=redis_url)
    try:
        wait_executors(url, 2)
        finished_before = metric(url, "requests_total")
        with ThreadPoolExecutor(1) as pool:
            texts = pool.submit(stream_all, url, PROMPTS, PAUSED_MAX_TOKENS)
            victim, address = executors[0]
            wait_generating(address)
            paused_at = num_steps(address)
            os.killpg(victim.pid, signal.SIGSTOP)
            time.sleep(7)  # the registry's TTL is 3 s
            os.killpg(victim.pid, signal.SIGCONT)
            assert texts.result() == [long_reference[p] for p in PROMPTS]
        # It was paused with work of its own, which it went on with.
        assert num_steps(address) > paused_at + 1
        assert metric(url, "requests_total") - finished_before == len(PROMPTS)
        assert sorted(wait_executors(url, 2)) == sorted(a for _, a in executors)
        wait_until(lambda: used_blocks(url) == 0, 10, "blocks freed")
        assert "executor vanished" not in scheduler.log_path.read_text()
    finally:
        stop(scheduler)
        for proc, _ in executors:
            stop(proc)


@pytest.mark.parametrize("num_executors", [1, 2], ids=["alone", "beside-another"])
def test_an_executor_restarted_at_its_address_recomputes_each_request_once(
    tiny_chat_model_dir, namespace, redis_url, reference, num_executors
):
    """kill -9 with streams in flight and a restart at the same address after its
    heartbeat lapsed: alone, its requests wait and are recomputed on the new process;
    beside another, they move there and the restarted one rejoins. Either way no token is
    doubled, each request finishes once, and every pool drains."""
    executors = [
        start_executor(tiny_chat_model_dir, namespace, redis=redis_url)
        for _ in range(num_executors)
    ]
    scheduler, url = start_scheduler(namespace, redis=redis_url)
    restarted = None
    try:
        wait_executors(url, num_executors)
        finished_before = metric(url, "requests_total")
        victim, address = executors[0]
        with ThreadPoolExecutor(1) as pool:
            texts = pool.submit(stream_all, url, PROMPTS)
            wait_generating(address)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            time.sleep(4)  # past the heartbeat's TTL: the registry says it is gone
            port = int(address.rsplit(":", 1)[1])
            restarted, _ = start_executor(
                tiny_chat_model_dir, namespace, redis=redis_url, port=port
            )
            assert texts.result() == [reference[p] for p in PROMPTS]
        assert metric(url, "requests_total") - finished_before == len(PROMPTS)
        assert address in wait_executors(url, num_executors)
        assert stream_all(url, PROMPTS[:2]) == [reference[p] for p in PROMPTS[:2]]
        wait_until(lambda: used_blocks(url) == 0, 10, "blocks freed")
    finally:
        stop(scheduler)
        for proc in [restarted, *(p for p, _ in executors[1:])]:
            if proc is not None:
                stop(proc)


def test_a_burst_of_requests_all_finish(tiny_chat_model_dir, namespace, redis_url):
    """400 requests at once into a pool that holds a fraction of them: they wait or are
    preempted, and each gets its whole answer (no empty text passed off as finished)."""
    executor, _ = start_executor(tiny_chat_model_dir, namespace, redis=redis_url, num_gpu_blocks=64)
    # No bound on the expected wait: measured on a loaded machine it could refuse some (429),
    # and this test is about those admitted finishing, not about admission.
    scheduler, url = start_scheduler(namespace, "--max-queue-wait", "0", redis=redis_url)
    try:
        wait_executors(url, 1)
        finished_before = metric(url, "requests_total")
        requests = [body(url, f"Burst {i}: the tide") | {"max_tokens": 8} for i in range(400)]

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=500)
            async with httpx.AsyncClient(timeout=600, limits=limits) as client:
                posts = [client.post(f"{url}/v1/completions", json=r) for r in requests]
                return await asyncio.gather(*posts)

        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * len(requests)
        for response in responses:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == requests[0]["max_tokens"]
        assert metric(url, "requests_total") - finished_before == len(requests)
        wait_until(lambda: used_blocks(url) == 0, 10, "blocks freed")
    finally:
        stop(scheduler)
        stop(executor)
