"""Wake-ups shared by both stores: the leader waiting for work, front doors waiting for events.

Followers get the events themselves as they are committed (`OnEvents`), so a front door
streaming tokens needs no store read per token; None instead of events means some may have
been missed (a reconnect) and the follower should read the list.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

Event = tuple[int, str]  # (index from 1, event JSON), as read_events returns them
OnEvents = Callable[[list[Event] | None], None]


class Watchers:
    """Request id -> event callbacks, safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: dict[str, set[OnEvents]] = {}

    def add(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        """Register `on_events` for `request_id`; returns the function that unregisters it."""
        with self._lock:
            self._callbacks.setdefault(request_id, set()).add(on_events)

        def unwatch() -> None:
            with self._lock:
                callbacks = self._callbacks.get(request_id)
                if callbacks is not None:
                    callbacks.discard(on_events)
                    if not callbacks:
                        del self._callbacks[request_id]

        return unwatch

    def push(self, events: list[tuple[str, int, str]]) -> None:
        """Hand committed (request_id, index, event JSON) triples to their watchers."""
        if not self._callbacks:  # the embedded engine's commits, with nobody following
            return
        by_request: dict[str, list[Event]] = {}
        for rid, index, text in events:
            by_request.setdefault(rid, []).append((index, text))
        with self._lock:
            calls = [
                (cb, evs) for rid, evs in by_request.items() for cb in self._callbacks.get(rid, ())
            ]
        for callback, evs in calls:
            callback(evs)

    def push_missed(self) -> None:
        """Tell every watcher that events may have gone by unseen."""
        with self._lock:
            callbacks = [cb for cbs in self._callbacks.values() for cb in cbs]
        for callback in callbacks:
            callback(None)


class WorkSignal:
    """A flag raised by submissions and abort requests, lowered by the waiter that sees it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._raised = False

    def notify(self) -> None:
        with self._cond:
            self._raised = True
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """True (and lowered) once raised; False when `timeout_s` passed first."""
        with self._cond:
            self._cond.wait_for(lambda: self._raised, timeout=max(timeout_s, 0.0))
            raised, self._raised = self._raised, False
            return raised


class _EventSource(Protocol):
    def read_events(self, request_id: str, after: int = 0) -> list[tuple[int, str]]: ...

    def watch_events(self, request_id: str, on_events: OnEvents) -> Callable[[], None]: ...


def wait_events(
    store: _EventSource, request_id: str, after: int, timeout_s: float
) -> list[tuple[int, str]]:
    """Events after `after`, as soon as one exists or when `timeout_s` passed (maybe []).

    The watch is registered before the reads, so an event committed between a read and the
    wait still wakes it. Simple rather than cheapest: it reads the list after every wake.
    """
    deadline = time.monotonic() + timeout_s
    woken = threading.Event()
    unwatch = store.watch_events(request_id, lambda _: woken.set())
    try:
        while True:
            woken.clear()
            events = store.read_events(request_id, after)
            remaining = deadline - time.monotonic()
            if events or remaining <= 0:
                return events
            woken.wait(remaining)
    finally:
        unwatch()
