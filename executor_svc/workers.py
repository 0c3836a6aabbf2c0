"""The worker processes of a tensor-parallel executor: rank 0 (the process that serves)
starts ranks 1..N-1, sends each of them every pool operation it applies itself, and dies
loudly when one of them dies, since its pools are useless without the missing heads.

A command goes down a pipe per worker; the workers never answer except to say they have
loaded the model or allocated the pools. Each command makes the same collectives, in the
same order, on every rank:

    rank 0:   recv RPC ─ send cmd to 1..N-1 ─ apply ──(all-reduces)── sample ─ reply
    rank r:              recv cmd ─────────── apply ──(all-reduces)── (no sampling)
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Protocol

import structlog
import torch
import torch.distributed as dist
from tqdm import tqdm

from executor_svc.parallel import Shard, join_group, pick_device
from pagedserve.settings import ExecutorConfig

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = structlog.get_logger("executor_svc.workers")

STOP_TIMEOUT_S = 10.0  # how long a worker gets to exit after "stop" before it is killed
# The commands a worker applies; each names a method of its Executor.
COMMANDS = ("init_cache", "execute", "copy_blocks", "swap_blocks")


class RankExecutor(Protocol):
    """What a worker builds from its shard and applies COMMANDS to: the Executor class,
    passed in so that this module does not import the one that imports it."""

    def __call__(self, config: ExecutorConfig, shard: Shard) -> object: ...


class WorkerFailed(RuntimeError):
    """A worker process died or refused to start."""


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: their processes, pipes and a watchdog."""

    def __init__(
        self, executor: RankExecutor, config: ExecutorConfig, device: torch.device
    ) -> None:
        """Start the workers and join the group with them as rank 0 (blocks until they
        have joined; they load their shards in parallel with ours)."""
        world_size = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        context = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._closing = threading.Event()
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(executor, config, rank, store.port, theirs),
                name=f"pagedserve-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # so their death reads as EOF here
            self.procs.append(proc)
            self.conns.append(ours)
        log.info("executor.workers_started", pids=[p.pid for p in self.procs])
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        self._store = store  # NCCL exchanges its ids through it at the first collective
        self.shard = join_group(0, world_size, store, device)

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard."""
        self._gather("ready")

    def send(self, name: str, *args: object) -> None:
        """Have every worker apply ``Executor.<name>(*args)``, as rank 0 is about to."""
        assert name in COMMANDS, name
        for conn in self.conns:
            conn.send((name, args))

    def wait_done(self) -> None:
        """Block until every worker has answered a command that answers (init_cache)."""
        self._gather("done")

    def _gather(self, expected: str) -> None:
        for rank, conn in enumerate(self.conns, 1):
            try:
                answer = conn.recv()
            except EOFError:
                raise WorkerFailed(f"tensor-parallel rank {rank} exited") from None
            if answer != expected:
                raise WorkerFailed(f"tensor-parallel rank {rank}: {answer}")

    def fail(self, reason: str) -> None:
        """The ranks may no longer run the same collectives: stop them all, exit the process."""
        log.error("executor.tensor_parallel_failed", reason=reason)
        self._closing.set()
        for proc in self.procs:
            proc.kill()
        os._exit(1)

    def close(self) -> None:
        """Stop the workers (idempotent); ones that do not stop in time are killed."""
        if self._closing.is_set():
            return
        self._closing.set()
        for conn in self.conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(("stop", ()))
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        log.info("executor.workers_stopped", exitcodes=[p.exitcode for p in self.procs])

    def _watch(self) -> None:
        """Wait for any worker to exit; unless we are closing, that is fatal."""
        sentinels = {proc.sentinel: proc for proc in self.procs}
        ended = wait(list(sentinels))
        if self._closing.is_set():
            return
        proc = sentinels[ended[0]]
        proc.join(1.0)
        self.fail(f"{proc.name} (pid {proc.pid}) exited with {proc.exitcode}")


def _worker_main(
    executor_class: RankExecutor, config: ExecutorConfig, rank: int, port: int, conn: Connection
) -> None:
    """A worker's whole life: join the group, load its shard, apply commands until told to
    stop or rank 0 goes away. Any error ends the process (rank 0 then fails loudly)."""
    from pagedserve.log import configure_logging

    # Only rank 0 stops us: a signal to the whole process group must not kill a worker
    # while rank 0 is still finishing its last step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    configure_logging()
    # The progress bar's default lock is a multiprocessing semaphore, which the quick
    # exit below would leave for the resource tracker to complain about.
    tqdm.set_lock(threading.RLock())
    device = pick_device(config.device, rank, config.tensor_parallel_size)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False)
    shard = join_group(rank, config.tensor_parallel_size, store, device)
    try:
        executor = executor_class(config, shard)
        conn.send("ready")
        _serve_commands(executor, conn)
    except Exception:
        log.exception("executor.worker_failed", rank=rank)
        raise SystemExit(1) from None
    # Nothing to save, and tearing down torch's modules takes seconds: leave at once.
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)


def _serve_commands(executor: object, conn: Connection) -> None:
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if name == "stop":
            return
        if name not in COMMANDS:
            raise ValueError(f"unknown command {name!r}")
        getattr(executor, name)(*args)
        if name == "init_cache":
            conn.send("done")


def _exit_with_parent() -> None:
    """Exit at once when rank 0 dies, even while blocked in a collective."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
