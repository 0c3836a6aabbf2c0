"""What counts as evidence that an executor is alive while its heartbeat has lapsed: a
step on the wire, also when the step sent ahead of it has already been answered. A fake
client isolates the unit; tests/scheduler_svc/test_liveness.py pauses a real executor."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from pagedserve.step import ExecuteStep, StepResult
from scheduler_svc.engine.executor_client import ExecutorUnavailable
from scheduler_svc.engine.reconnect import ReconnectingExecutor


class PausedClient:
    """Answers each step only when told to; GetStats never answers (a paused process)."""

    address = "paused:1"

    def __init__(self) -> None:
        self.answered: dict[int, threading.Event] = {}

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        done = self.answered.setdefault(step.step_id, threading.Event())

        def result() -> StepResult:
            done.wait(10)
            return StepResult(step_id=step.step_id, outputs=[])

        return result

    def get_stats(self, timeout: float) -> None:
        raise ExecutorUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "paused")


def test_a_step_on_the_wire_is_evidence_after_the_one_before_it_answered() -> None:
    client = PausedClient()
    executor = ReconnectingExecutor(client, instance_id="a")  # type: ignore[arg-type]
    assert not executor.answers()  # nothing on the wire, no answer to a probe
    first = executor.start(ExecuteStep(step_id=1, epoch=1, seqs=[]))
    # sent ahead of the first's answer:
    second = executor.start(ExecuteStep(step_id=2, epoch=1, seqs=[]))
    client.answered[1].set()
    assert first().step_id == 1
    assert executor.answers()  # step 2 is still on the wire
    client.answered[2].set()
    assert second().step_id == 2
    assert not executor.answers()
