"""The processes a fault scenario runs against: a private redis-server, registered
executors and scheduler replicas on one namespace, each stoppable, killable and restartable."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.fault_proxy import FaultProxy
from tests.cluster import metric, start_scheduler, wait_executors
from tests.redis_server import RedisServer
from tests.services import free_port, start, stop

NUM_GPU_BLOCKS = 256


@dataclass
class ClusterConfig:
    """What a scenario's deployment looks like."""

    model_dir: Path
    num_schedulers: int = 1
    store_budget_s: float = 30.0
    # Small enough that the overload scenario's minute fills it (the default is 1,024).
    max_waiting_requests: int = 128
    finished_ttl_s: float = 3600.0  # the default; a soak shortens it to see the keys level off
    proxies: bool = True  # schedulers reach the executor and Redis through FaultProxies


@dataclass
class Cluster:
    """One redis-server, one registered executor and ``num_schedulers`` replicas; with
    ``proxies`` the replicas reach the other two through a FaultProxy each."""

    config: ClusterConfig
    data_dir: Path
    namespace: str = field(default_factory=lambda: f"faults-{uuid.uuid4().hex[:12]}")
    redis: RedisServer | None = None
    executor: subprocess.Popen | None = None
    executor_address: str = ""
    schedulers: dict[str, subprocess.Popen] = field(default_factory=dict)
    proxies: dict[str, FaultProxy] = field(default_factory=dict)  # "executor", "redis"
    # Set by the suite once its baseline ran: what an overload multiplies and sends.
    sustainable_rate_req_s: float = 0.0
    load: list = field(default_factory=list)  # the suite's Specs

    def start_redis(self) -> None:
        self.redis = RedisServer(self.data_dir)
        self.redis.start()

    def start_executor(self, port: int) -> None:
        """Start the executor on ``port``, registered under its proxy's address if any."""
        proxy = self.proxies.get("executor")
        self.executor_address = f"127.0.0.1:{port}"
        args = ["executor", "--port", str(port), "--model", str(self.config.model_dir)]
        args += ["--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--swap-space", "0.05"]
        args += ["--state-store", self.redis.url, "--namespace", self.namespace]
        args += ["--drain-timeout", "3", "--metrics-port", "0"]
        args += ["--advertise-address", proxy.address if proxy else self.executor_address]
        self.executor = start(args, f"faults-executor-{port}-{time.monotonic_ns()}.log")

    def start_scheduler(self) -> str:
        """A new replica, once healthy; returns its URL."""
        flags = ["--store-budget", str(self.config.store_budget_s)]
        flags += ["--max-waiting-requests", str(self.config.max_waiting_requests)]
        flags += ["--finished-ttl", str(self.config.finished_ttl_s)]
        store = self.redis.url
        if "redis" in self.proxies:
            store = f"redis://{self.proxies['redis'].address}/0"
        proc, url = start_scheduler(self.namespace, *flags, redis=store)
        self.schedulers[url] = proc
        return url

    def start(self) -> None:
        self.start_redis()
        port = free_port()
        if self.config.proxies:
            self._add_proxy("redis", self.redis.port)
            self._add_proxy("executor", port)
        self.start_executor(port)
        for _ in range(self.config.num_schedulers):
            self.start_scheduler()
        wait_executors(self.urls()[0], 1, timeout=120)

    def _add_proxy(self, name: str, port: int) -> None:
        self.proxies[name] = FaultProxy("127.0.0.1", port)
        self.proxies[name].start()

    def stop(self) -> None:
        """Stop every process this cluster started; safe to call at any point. SIGTERM
        goes to all first, so their shutdowns overlap."""
        procs = [*self.schedulers.values(), *([self.executor] if self.executor else [])]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.schedulers.values():
            stop(proc)
        for proxy in self.proxies.values():
            proxy.close()
        if self.executor is not None:
            stop(self.executor)
        if self.redis is not None:
            self.redis.stop()

    def urls(self) -> list[str]:
        """The scheduler replicas still running."""
        return [url for url, proc in self.schedulers.items() if proc.poll() is None]

    def leader(self, timeout: float = 30.0) -> str:
        """The URL of the replica that leads, waiting for one to take the lease."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for url in self.urls():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    if httpx.get(f"{url}/health", timeout=2).json().get("leading"):
                        return url
            time.sleep(0.2)
        raise TimeoutError(f"no leader among {self.urls()} within {timeout} s")

    def kill_scheduler(self, url: str) -> None:
        kill_9(self.schedulers[url])

    def kill_executor(self) -> int:
        """kill -9 the executor; returns the port to restart it on."""
        kill_9(self.executor)
        return int(self.executor_address.rsplit(":", 1)[1])

    def num_requests(self) -> float:
        """Requests the leader holds: running, waiting and swapped."""
        return metric(self.leader(), "num_requests")

    def used_blocks(self) -> float:
        """KV blocks in use (gpu and cpu pools) on the leader."""
        return metric(self.leader(), "kv_blocks_used")

    def wait_drained(self, timeout: float) -> float:
        """Poll until the leader's pools are back to 0 used blocks; returns what stays used
        (NaN when no replica answers)."""
        deadline = time.monotonic() + timeout
        used = float("nan")
        while self.urls() and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                used = self.used_blocks()
                if used == 0:
                    return 0.0
            time.sleep(0.5)
        return used

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of every running process, by role."""
        procs = {f"scheduler {i}": p for i, p in enumerate(self.schedulers.values())}
        procs["executor"] = self.executor
        sizes = {name: rss_of(p.pid) for name, p in procs.items() if p.poll() is None}
        if self.redis is not None and self.redis.proc.poll() is None:
            sizes["redis"] = rss_of(self.redis.proc.pid)
        return sizes

    def redis_keys(self) -> dict[str, int]:
        """The namespace's keys in Redis: all, and those that never expire (a finished
        request's keep an hour's TTL)."""
        import redis

        client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        try:
            keys = list(client.scan_iter(match=f"{self.namespace}:*", count=1000))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.ttl(key)
            return {"total": len(keys), "without_ttl": sum(t == -1 for t in pipe.execute())}
        finally:
            client.close()


def kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL a service's whole process group (the executor's workers too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def rss_of(pid: int) -> float:
    """Resident set size in MiB, read from /proc (Linux); the process's children summed in."""
    total = 0.0
    for p in [pid, *children_of(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return round(total, 1)


def children_of(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(c) for c in text.split()]
    return []
