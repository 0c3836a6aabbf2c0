"""Riding out an executor that goes away: the engine waits instead of failing requests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from pagedserve.step import ExecuteStep, ExecutorRestarted, StepResult
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorError, ExecutorUnavailable

log = structlog.get_logger(__name__)

PROBE_TIMEOUT_S = 2.0  # a probe's deadline: GetStats answers without waiting for a step


class ExecutorGone(RuntimeError):
    """The executor was given up for good (it vanished from the registry or its drain
    budget ran out): its groups must be recomputed on another executor."""


class Halted(RuntimeError):
    """The term ended while the engine waited for its executor: the call in flight is left
    to the next term (this process's or a successor's), whose recovery replays the pending
    step or recomputes past the journal, as after a crash."""


class ReconnectingExecutor:
    """Resends a step until the executor answers again.

    A step is applied once per step id, so resending the same step to the same executor
    process is safe. An executor that returns as a new process (another instance id) has
    lost its pools: ``execute`` then raises ExecutorRestarted and the engine recomputes.
    """

    def __init__(self, client: ExecutorClient, instance_id: str, poll_s: float = 0.5) -> None:
        self.client = client
        self.instance_id = instance_id
        self.poll_s = poll_s
        self.down_since: float | None = None  # monotonic time of the first failure
        # Execute calls on the wire that have neither answered nor failed: two while a
        # step is sent ahead of the answer to the one before it.
        self._on_wire: set[Callable[[], StepResult]] = set()
        self.abandoned = False
        self._halted = threading.Event()

    def abandon(self) -> None:
        """Make the step in flight, or the next one, raise ExecutorGone instead of waiting."""
        self.abandoned = True

    def halt(self) -> None:
        """Make a wait for the executor, now or later, raise Halted: the term ended, and a
        shutdown must not wait for an executor that stops with it (`pagedserve serve`'s,
        under a signal to the whole process group)."""
        self._halted.set()

    def execute(self, step: ExecuteStep) -> StepResult:
        return self.start(step)()

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        """Send ``step`` now; calling the result waits for its answer, resending the step
        after the executor answers ``InitCache`` again for as long as it is away."""
        call = self._send(step)

        def result() -> StepResult:
            nonlocal call
            while True:
                try:
                    answer = call()
                except ExecutorUnavailable as e:
                    error = e
                else:
                    self.down_since = None
                    return answer
                finally:
                    self._on_wire.discard(call)
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    log.warning(
                        "executor unavailable, waiting",
                        executor=self.client.address,
                        error=str(error),
                    )
                self._reconnect()
                call = self._send(step)

        return result

    def _send(self, step: ExecuteStep) -> Callable[[], StepResult]:
        self._check()
        call = self.client.start(step)
        self._on_wire.add(call)
        return call

    def fence(self, epoch: int) -> int | None:
        """``ExecutorClient.fence``, waiting for an executor that is away (a new process
        has applied no step: it answers None)."""
        while True:
            try:
                return self.client.fence(epoch)
            except ExecutorUnavailable:
                self._pause()

    def end_steps(self, step_id: int) -> None:
        self.client.end_steps(step_id)

    def _check(self) -> None:
        if self._halted.is_set():
            raise Halted(self.client.address)
        if self.abandoned:
            raise ExecutorGone(self.client.address)

    def _pause(self) -> None:
        """Wait a poll period before trying the executor again, unless told to stop."""
        self._check()
        self._halted.wait(self.poll_s)
        self._check()

    def _reconnect(self) -> None:
        while True:
            self._check()
            try:
                info = self.client.init_cache()  # allocates afresh on a new process
                break
            except ExecutorUnavailable:
                self._pause()
        if info.instance_id != self.instance_id:
            log.warning("executor restarted; recomputing", instance_id=info.instance_id)
            self.instance_id = info.instance_id
            self.down_since = None
            raise ExecutorRestarted(info.instance_id)

    def answers(self) -> bool:
        """Whether the executor is alive, on evidence: a step on the wire that has not
        failed, or a GetStats that answers now (whatever its instance id: a restarted
        process at this address is this lane's to recompute on)."""
        if self._on_wire and self.down_since is None:
            return True
        try:
            self.client.get_stats(timeout=PROBE_TIMEOUT_S)
        except ExecutorError:
            return False
        return True

    def unavailable_for(self) -> float:
        """Seconds the executor has been away (0 while it answers)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since
