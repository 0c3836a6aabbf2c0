"""Riding out an executor that goes away: the engine waits instead of failing requests."""

from __future__ import annotations

import time

import structlog

from pagedserve.step import ExecuteStep, ExecutorRestarted, StepResult
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable

log = structlog.get_logger(__name__)


class ExecutorGone(RuntimeError):
    """The executor was given up for good (it vanished from the registry or its drain
    budget ran out): its groups must be recomputed on another executor."""


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
        self.abandoned = False

    def abandon(self) -> None:
        """Make the step in flight, or the next one, raise ExecutorGone instead of waiting."""
        self.abandoned = True

    def execute(self, step: ExecuteStep) -> StepResult:
        while True:
            if self.abandoned:
                raise ExecutorGone(self.client.address)
            try:
                result = self.client.execute(step)
                self.down_since = None
                return result
            except ExecutorUnavailable as e:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    log.warning(
                        "executor unavailable, waiting", executor=self.client.address, error=str(e)
                    )
                self._reconnect()

    def _reconnect(self) -> None:
        while True:
            if self.abandoned:
                raise ExecutorGone(self.client.address)
            try:
                info = self.client.init_cache()  # allocates afresh on a new process
                break
            except ExecutorUnavailable:
                time.sleep(self.poll_s)
        if info.instance_id != self.instance_id:
            log.warning("executor restarted; recomputing", instance_id=info.instance_id)
            self.instance_id = info.instance_id
            self.down_since = None
            raise ExecutorRestarted(info.instance_id)

    def unavailable_for(self) -> float:
        """Seconds the executor has been away (0 while it answers)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since
