"""What counts as evidence that an executor is alive while its heartbeat has lapsed: a
step on the wire, also when the step sent ahead of it has already been answered. A fake
client isolates the unit; tests/scheduler_svc/test_liveness.py pauses a real executor."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest

from pagedserve.step import ExecuteStep, StepResult
from scheduler_svc.engine.executor_client import ExecutorUnavailable
from scheduler_svc.engine.reconnect import Halted, ReconnectingExecutor


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


class GoneClient:
    """An executor that went away for good: every call fails as unreachable."""

    address = "gone:1"

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        def result() -> StepResult:
            raise ExecutorUnavailable(grpc.StatusCode.UNAVAILABLE, "connection refused")

        return result

    def init_cache(self) -> None:
        raise ExecutorUnavailable(grpc.StatusCode.UNAVAILABLE, "connection refused")

    def fence(self, epoch: int) -> None:
        raise ExecutorUnavailable(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_halt_ends_the_waits_for_an_executor_that_is_gone() -> None:
    """A step's answer and a fence each wait for the executor to return, until the term
    ends: then they raise Halted, the step and fence in flight as well as later ones."""
    executor = ReconnectingExecutor(GoneClient(), instance_id="a", poll_s=0.05)  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def wait(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as e:
            raised.append(e)

    step = ExecuteStep(step_id=1, epoch=1, seqs=[])
    waiters = [
        threading.Thread(target=wait, args=(executor.start(step),)),
        threading.Thread(target=wait, args=(lambda: executor.fence(2),)),
    ]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.3)  # several polls: both are waiting
    assert not raised and executor.unavailable_for() > 0
    executor.halt()
    for waiter in waiters:
        waiter.join(timeout=5)
    assert [type(e) for e in raised] == [Halted, Halted]
    with pytest.raises(Halted):
        executor.start(ExecuteStep(step_id=2, epoch=1, seqs=[]))
