"""Two scheduler replicas on one Redis: one leads the engine through a lease with a fencing
epoch, both serve clients. kill -9 of the leader hands over to the standby with greedy text
byte-identical to an uninterrupted run; a leader paused past its lease (SIGSTOP, SIGCONT)
is fenced off and steps down. Real processes: an executor, two schedulers, redis-server."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from scheduler_svc.engine.executor_client import ExecutorClient
from tests.cluster import (
    complete,
    health,
    num_steps,
    reference_texts,
    start_executor,
    start_scheduler,
    stream_text,
    wait_until,
)
from tests.services import held_still, stop

pytestmark = pytest.mark.redis
LEASE_TTL = 2.0
PROMPTS = [f"Dispatch {i}: the ferry left the harbour at dawn and" for i in range(6)]


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir: Path) -> dict[str, str]:
    return reference_texts(tiny_chat_model_dir, PROMPTS)


@pytest.fixture
def replicas(tiny_chat_model_dir: Path, redis_url: str):
    """An executor and two scheduler replicas; yields (leader, standby, executor address,
    executor process)."""
    namespace = f"test-replicas-{uuid.uuid4().hex}"
    executor, address = start_executor(tiny_chat_model_dir, namespace, redis=redis_url, drain_s=3)
    # One decode step a call: the tests pause and kill the leader mid-generation, and at
    # 8 steps a call the six requests could finish before the signal lands.
    flags = ("--lease-ttl", str(LEASE_TTL), "--num-decode-steps", "1")
    schedulers = []
    try:
        schedulers.append(start_scheduler(namespace, *flags, redis=redis_url))
        wait_until(lambda: health(schedulers[0][1])["leading"], 30, "the first replica leads")
        schedulers.append(start_scheduler(namespace, *flags, redis=redis_url))
        yield schedulers[0], schedulers[1], address, executor
    finally:
        for proc, _ in schedulers:
            os.killpg(proc.pid, signal.SIGCONT)  # a test may leave one stopped
            stop(proc)
        stop(executor)


def test_kill_9_of_the_leader_hands_over_to_the_standby(replicas, reference):
    (leader, leader_url), (_, standby_url), address, _ = replicas
    assert not health(standby_url)["leading"]
    ids = [f"req-{uuid.uuid4().hex}" for _ in PROMPTS[1:]]

    def first_try(i: int) -> None:  # cut off by the kill
        with contextlib.suppress(httpx.HTTPError, AssertionError):
            complete(leader_url, PROMPTS[i + 1], ids[i])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streamed = pool.submit(stream_text, standby_url, PROMPTS[0])  # served by the standby
        cut = [pool.submit(first_try, i) for i in range(len(ids))]
        wait_until(lambda: num_steps(address) >= 4, 60, "generation under way")
        os.killpg(leader.pid, signal.SIGKILL)
        took = wait_until(lambda: health(standby_url)["leading"], 30, "the standby leads")
        for f in cut:
            f.result()
        retried = [complete(standby_url, p, i) for p, i in zip(PROMPTS[1:], ids, strict=True)]
        assert streamed.result() == reference[PROMPTS[0]]
    assert retried == [reference[p] for p in PROMPTS[1:]]
    assert took < 3 * LEASE_TTL


def test_a_paused_leader_is_fenced_off_and_steps_down(replicas, reference):
    (leader, leader_url), (_, standby_url), address, executor = replicas
    with ThreadPoolExecutor(len(PROMPTS)) as pool, ExecutorClient(address) as client:
        futures = [pool.submit(complete, standby_url, p) for p in PROMPTS]
        seen = []  # the executor's stats once generation is under way

        def under_way() -> bool:
            seen.append(client.get_stats())
            return seen[-1].num_steps >= 4

        wait_until(under_way, 60, "generation under way")
        old_epoch = seen[-1].epoch
        # The executor held still until the leader is: no request can finish in between,
        # so the standby finds work to step with its new epoch.
        with held_still(executor.pid):
            os.killpg(leader.pid, signal.SIGSTOP)
        wait_until(lambda: health(standby_url)["leading"], 30, "the standby leads")
        # It leads from the moment it takes the lease; its epoch reaches the executor with
        # its first step.
        wait_until(lambda: client.get_stats().epoch > old_epoch, 30, "the new epoch steps")
        new_epoch = client.get_stats().epoch
        os.killpg(leader.pid, signal.SIGCONT)  # wakes up believing it leads
        wait_until(lambda: not health(leader_url)["leading"], 30, "the old leader steps down")
        texts = [f.result() for f in futures]
    assert texts == [reference[p] for p in PROMPTS]
    with ExecutorClient(address) as client:  # the old epoch never stepped the executor again
        assert client.get_stats().epoch == new_epoch
    # The old leader serves clients as a follower of the new one.
    assert complete(leader_url, PROMPTS[0]) == reference[PROMPTS[0]]
    assert health(standby_url)["leading"]
