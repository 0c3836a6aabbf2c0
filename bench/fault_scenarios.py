"""The faults the suite injects, each a function of a running Cluster that returns a note
on what it did (and saw)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.fault_cluster import Cluster
from tests.cluster import model_of

REDIS_DOWN_S = 3.0
EXECUTOR_DOWN_S = 2.0
PAUSE_S = 15.0
STALL_S = 15.0  # past the executor client's 10 s keepalive ping and the 3 s lease
PARTITION_S = 8.0
LATENCY_S = 0.05  # each direction, each chunk
LATENCY_FOR_S = 10.0
NUM_ABANDONING = 40


@dataclass(frozen=True)
class Scenario:
    """A fault and the deployment it needs."""

    key: str  # as --scenarios names it
    name: str
    fault: Callable[[Cluster], str]
    min_schedulers: int = 1  # replicas it needs running


def no_fault(cluster: Cluster) -> str:
    return "undisturbed; its texts are the reference"


def redis_kill_9(cluster: Cluster) -> str:
    cluster.redis.kill()
    time.sleep(REDIS_DOWN_S)
    cluster.redis.start()
    return f"down {REDIS_DOWN_S:.0f} s, restarted on its AOF"


def redis_restarted_empty(cluster: Cluster) -> str:
    """kill -9, the append-only file deleted, a restart: the journal is gone."""
    cluster.redis.restart_empty()
    return "kill -9, data deleted, restarted empty"


def redis_paused(cluster: Cluster) -> str:
    cluster.redis.pause()
    time.sleep(PAUSE_S)
    cluster.redis.resume()
    return f"SIGSTOP {PAUSE_S:.0f} s, SIGCONT"


def executor_kill_9(cluster: Cluster) -> str:
    port = cluster.kill_executor()
    time.sleep(EXECUTOR_DOWN_S)
    cluster.start_executor(port)
    return f"down {EXECUTOR_DOWN_S:.0f} s, restarted at its address"


def leader_kill_9(cluster: Cluster) -> str:
    leader = cluster.leader()
    start = time.monotonic()
    cluster.kill_scheduler(leader)
    cluster.leader(timeout=60)
    return f"a standby led after {time.monotonic() - start:.1f} s"


def network_latency(cluster: Cluster) -> str:
    for proxy in cluster.proxies.values():
        proxy.latency_s = LATENCY_S
    time.sleep(LATENCY_FOR_S)
    for proxy in cluster.proxies.values():
        proxy.latency_s = 0.0
    return f"+{LATENCY_S * 1e3:.0f} ms each way for {LATENCY_FOR_S:.0f} s"


def network_stall(cluster: Cluster) -> str:
    cluster.proxies["executor"].stall(True)
    time.sleep(STALL_S)
    cluster.proxies["executor"].stall(False)
    return f"scheduler-executor bytes held {STALL_S:.0f} s"


def network_reset(cluster: Cluster) -> str:
    for _ in range(3):
        for proxy in cluster.proxies.values():
            proxy.reset()
        time.sleep(2)
    return "every connection reset, 3 times 2 s apart"


def network_partition(cluster: Cluster) -> str:
    for proxy in cluster.proxies.values():
        proxy.partition(True)
    time.sleep(PARTITION_S)
    for proxy in cluster.proxies.values():
        proxy.partition(False)
    return f"both links cut {PARTITION_S:.0f} s, then healed"


def abandoning_clients(cluster: Cluster) -> str:
    """Clients that open a stream, read its first chunk and close the socket."""
    urls, model = cluster.urls(), model_of(cluster.urls()[0])

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Abandoned {i}: the tide", "max_tokens": 64}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        url = f"{urls[i % len(urls)]}/v1/completions"
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_ABANDONING)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"{NUM_ABANDONING} extra streams closed after their first chunk"


SCENARIOS = {  # in the order they run: each leaves the deployment whole but the last two
    s.key: s
    for s in [
        Scenario("baseline", "no fault", no_fault),
        Scenario("redis-kill", "redis kill -9, AOF restart", redis_kill_9),
        Scenario("executor-kill", "executor kill -9, restart", executor_kill_9),
        Scenario("redis-pause", "redis SIGSTOP 15 s", redis_paused),
        Scenario("net-latency", "net latency, exec+redis", network_latency),
        Scenario("net-stall", "net stall 15 s, exec", network_stall),
        Scenario("net-reset", "net resets, exec+redis", network_reset),
        Scenario("net-partition", "net partition 8 s, exec+redis", network_partition),
        Scenario("abandon", "clients close mid-stream", abandoning_clients),
        Scenario("leader-kill", "leader kill -9, 2 standbys", leader_kill_9, min_schedulers=3),
        Scenario("redis-empty", "redis restarted empty", redis_restarted_empty),
    ]
}
