"""The faults the suite injects, each a function of a running Cluster that returns a note
on what it did (and saw)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from bench.fault_cluster import Cluster
from bench.fault_load import Client, Outcome, Record, run_paced
from tests.cluster import model_of

REDIS_DOWN_S = 3.0
EXECUTOR_DOWN_S = 2.0
PAUSE_S = 15.0
STALL_S = 15.0  # past the executor client's 10 s keepalive ping and the 3 s lease
PARTITION_S = 8.0
LATENCY_S = 0.05  # each direction, each chunk
LATENCY_FOR_S = 10.0
NUM_ABANDONING = 40
NUM_STREAMS_AT_KILL = 64
NUM_SLOW_READERS = 16
SLOW_READ_S = 20.0
SLOW_READER_TOKENS = 512
OVERLOAD_FACTOR = 10  # times the rate the baseline finished
OVERLOAD_S = 60.0
OVERLOAD_IN_FLIGHT = 1024  # client threads: enough that the server, not the client, refuses


@dataclass(frozen=True)
class Scenario:
    """A fault and the deployment it needs."""

    key: str  # as --scenarios names it
    name: str
    fault: Callable[[Cluster], str | tuple[str, list[Record]]]  # a note (and extra records)
    min_schedulers: int = 1  # replicas it needs running
    streams: int = 0  # clients of the load, all streaming (0: --concurrency, half streaming)


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
    """The kill waits (up to 30 s) for NUM_STREAMS_AT_KILL requests to be held."""
    deadline = time.monotonic() + 30
    while (in_flight := cluster.num_requests()) < NUM_STREAMS_AT_KILL:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    port = cluster.kill_executor()
    time.sleep(EXECUTOR_DOWN_S)
    cluster.start_executor(port)
    return f"{in_flight:.0f} requests held at the kill; down {EXECUTOR_DOWN_S:.0f} s, restarted"


def executor_and_leader_kill_9(cluster: Cluster) -> str:
    """Both at once: a standby must take the lease and adopt a restarted executor."""
    leader, in_flight = cluster.leader(), cluster.num_requests()
    start = time.monotonic()
    cluster.kill_scheduler(leader)
    port = cluster.kill_executor()
    time.sleep(EXECUTOR_DOWN_S)
    cluster.start_executor(port)
    cluster.leader(timeout=60)
    return (
        f"{in_flight:.0f} requests held; executor back after {EXECUTOR_DOWN_S:.0f} s, "
        f"a standby led after {time.monotonic() - start:.1f} s"
    )


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


def slow_readers(cluster: Cluster) -> str:
    """Streams whose clients read one byte a second through a small receive buffer: the
    server must neither stall the other streams nor buffer without bound."""
    before = cluster.rss_mib()
    urls, model = cluster.urls(), model_of(cluster.urls()[0])
    sockets = [open_slow_stream(urls[i % len(urls)], model, i) for i in range(NUM_SLOW_READERS)]
    num_read, end = 0, time.monotonic() + SLOW_READ_S
    try:
        while time.monotonic() < end:
            for sock in sockets:
                with contextlib.suppress(OSError):
                    num_read += len(sock.recv(1))
            time.sleep(1.0)
        after = cluster.rss_mib()
    finally:
        for sock in sockets:
            sock.close()
    growth = ", ".join(
        f"{name} {after[name] - size:+.0f}" for name, size in before.items() if name in after
    )
    return f"{NUM_SLOW_READERS} streams read 1 B/s for {SLOW_READ_S:.0f} s; RSS MiB {growth}"


def open_slow_stream(url: str, model: str, index: int) -> socket.socket:
    """A streaming completion sent over a raw socket with a 4 KiB receive buffer; the
    caller reads it as slowly as it likes."""
    body = {"model": model, "prompt": f"Slow reader {index}: the lighthouse", "stream": True}
    body |= {"max_tokens": SLOW_READER_TOKENS, "ignore_eos": True, "temperature": 0}
    data = json.dumps(body).encode()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    sock.settimeout(0.05)
    return sock


def overload(cluster: Cluster) -> tuple[str, list[Record]]:
    """Ten times the rate the baseline finished, for a minute, from clients that try once:
    every request either finishes or is refused with 429/503 and a Retry-After, and
    resident memory stays bounded (the peak of each process is sampled every second)."""
    rate = OVERLOAD_FACTOR * cluster.sustainable_rate_req_s
    client = Client(cluster.urls, model_of(cluster.urls()[0]), deadline_s=120.0, retry=False)
    start, peak, done = cluster.rss_mib(), {}, threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            for name, size in cluster.rss_mib().items():
                peak[name] = max(peak.get(name, 0.0), size)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        records = run_paced(client, cluster.load, rate, OVERLOAD_S, OVERLOAD_IN_FLIGHT)
    finally:
        done.set()
        sampler.join()
    refused = sum(r.outcome is Outcome.FAILED for r in records)
    rss = ", ".join(
        f"{name} {size:.0f}->{peak.get(name, size):.0f}" for name, size in start.items()
    )
    note = f"{len(records)} more sent at {rate:.0f}/s for {OVERLOAD_S:.0f} s, one try each: "
    note += f"{refused} refused with Retry-After; peak RSS MiB {rss}"
    return note, records


SCENARIOS = {  # in the order they run: each leaves the deployment whole but the last three
    s.key: s
    for s in [
        Scenario("baseline", "no fault", no_fault),
        Scenario("redis-kill", "redis kill -9, AOF restart", redis_kill_9),
        Scenario("executor-kill", "executor kill -9, 64 streams", executor_kill_9, streams=80),
        Scenario("redis-pause", "redis SIGSTOP 15 s", redis_paused),
        Scenario("net-latency", "net latency, exec+redis", network_latency),
        Scenario("net-stall", "net stall 15 s, exec", network_stall),
        Scenario("net-reset", "net resets, exec+redis", network_reset),
        Scenario("net-partition", "net partition 8 s, exec+redis", network_partition),
        Scenario("abandon", "clients close mid-stream", abandoning_clients),
        Scenario("slow-readers", "clients read 1 B/s", slow_readers),
        Scenario("overload", "10x sustainable rate, 60 s", overload),
        Scenario("leader-kill", "leader kill -9, 2 standbys", leader_kill_9, min_schedulers=3),
        Scenario(
            "both-kill", "executor + leader kill -9", executor_and_leader_kill_9, min_schedulers=2
        ),
        Scenario("redis-empty", "redis restarted empty", redis_restarted_empty),
    ]
}
