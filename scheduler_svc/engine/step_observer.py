"""The hook through which metrics and the dashboard see every engine step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import LLMEngine, StepOutcome


class StepObserver(Protocol):
    """Something that reads an engine between its steps (metrics, the block map).

    ``after_step`` runs on the thread that steps ``engine``, right after each pass of its
    loop (adds and aborts applied, then a step when there was work): the one moment when
    nothing else touches that engine, so its scheduler and block manager can be read
    without locks. ``name`` tells the engines of several executors apart.
    """

    def after_step(self, name: str, engine: LLMEngine, outcome: StepOutcome) -> None: ...

    def forget(self, name: str) -> None:
        """The executor ``name`` left: drop what was kept about it."""
        ...


class StepObservers:
    """Several observers behind the one hook the engine loop calls."""

    def __init__(self, observers: list[StepObserver]) -> None:
        self.observers = observers

    def after_step(self, name: str, engine: LLMEngine, outcome: StepOutcome) -> None:
        for observer in self.observers:
            observer.after_step(name, engine, outcome)

    def forget(self, name: str) -> None:
        for observer in self.observers:
            observer.forget(name)
