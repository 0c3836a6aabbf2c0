"""Many executors behind one scheduler, found through the Redis registry: requests spread,
prefix-sharing requests land together, a new executor takes work, and an executor that is
drained (SIGTERM) or killed (kill -9) under load loses no request. Real processes: executors,
scheduler, redis-server; greedy text is compared with an uninterrupted offline run."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cluster import (
    complete,
    complete_all,
    num_steps,
    reference_texts,
    start_executor,
    start_scheduler,
    wait_executors,
)
from tests.services import stop

pytestmark = pytest.mark.redis
PROMPTS = [f"Report {i}: the harbour committee met on day {i} and" for i in range(10)]
SHARED = "You are the harbour master's assistant. Answer in one short sentence. " * 3
SHARED_PROMPTS = [SHARED + f"Question {i}?" for i in range(4)]


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS + SHARED_PROMPTS)


@pytest.fixture
def namespace() -> str:
    return f"test-scale-{uuid.uuid4().hex}"


@pytest.fixture
def deployment(tiny_chat_model_dir: Path, namespace: str, redis_url: str):
    """Two registered executors and a scheduler that finds them in Redis."""
    executors = [
        start_executor(tiny_chat_model_dir, namespace, redis=redis_url, drain_s=6) for _ in range(2)
    ]
    procs = [proc for proc, _ in executors]
    try:
        scheduler, url = start_scheduler(namespace, redis=redis_url)
        procs.append(scheduler)  # stopped last: it releases the draining executors at once
        wait_executors(url, 2)
        yield url, executors
    finally:
        for proc in procs:
            stop(proc)


def test_requests_spread_and_shared_prefixes_land_together(deployment, reference):
    url, executors = deployment
    addresses = [address for _, address in executors]
    assert complete_all(url, PROMPTS) == [reference[p] for p in PROMPTS]
    before = [num_steps(a) for a in addresses]
    assert all(steps > 0 for steps in before), before  # both executors took requests

    for prompt in SHARED_PROMPTS:  # one after another: each finds the prefix where the first went
        assert complete(url, prompt) == reference[prompt]
    grew = [num_steps(a) > b for a, b in zip(addresses, before, strict=True)]
    assert grew.count(True) == 1, grew


def test_a_third_executor_added_under_load_takes_work(
    deployment, namespace, redis_url, tiny_chat_model_dir, reference
):
    url, _ = deployment
    third = None
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            early = [pool.submit(complete, url, p) for p in PROMPTS[:5]]
            third, third_address = start_executor(tiny_chat_model_dir, namespace, redis=redis_url)
            wait_executors(url, 3)  # no restart: the scheduler found it in the registry
            late = [pool.submit(complete, url, p) for p in PROMPTS[5:]]
            texts = [f.result() for f in early + late]
        assert texts == [reference[p] for p in PROMPTS]
        assert num_steps(third_address) > 0
    finally:
        if third is not None:
            stop(third)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_losing_an_executor_under_load_loses_no_request(deployment, reference, sig):
    url, executors = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(complete, url, p) for p in PROMPTS]
        victim, address = executors[0]
        deadline = time.monotonic() + 60
        while num_steps(address) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # it runs requests now
        os.killpg(victim.pid, sig)
        texts = [f.result() for f in futures]
    assert texts == [reference[p] for p in PROMPTS]
    if sig == signal.SIGTERM:  # released (or out of drain budget): it exits by itself
        assert victim.wait(timeout=30) == 0
    assert wait_executors(url, 1) == [executors[1][1]]
