"""The scheduler's persisted state: one atomic commit per engine step, and a reload after restart.

Values are opaque JSON strings written by the engine; a store never parses them. Two
implementations: `InMemoryStateStore` (embedded default, here) and `RedisStateStore`
(`scheduler_svc/state/redis_store.py`).

Rules shared by both stores:

* Fencing: `begin_epoch()` makes a new leader. A commit from an older epoch raises
  `StaleEpochError`; one from a newer epoch than the store's is a caller bug (`ValueError`).
* Retries: commits are ordered by `(epoch, commit_id)`. A commit at or below the last applied
  one in the same epoch is a retry: ignored, `commit()` returns False. A new leader may restart
  its ids at 1 or continue from `load().last_commit_id`.
* Inside a commit the order is: meta, group upserts, group appends, group deletes, groups
  taken over (deleted from the lane they moved from), pending step, events, consumed
  submissions. An append adds a newline and its text to the group's
  value; appending to a group the store does not hold refuses the whole commit (ValueError).
* A submitted record lives while its request is queued, has a group, or has events; the
  commit or `delete_events` that ends the last of these drops it (its id may then be reused).
* Replicas: any replica submits requests, asks for aborts and follows events; only the
  leader takes aborts (fenced by its epoch, so a deposed leader cannot swallow them). It
  takes them before it reads `pending_requests()` and applies them after adding those, so an
  abort is never seen before its request. Aborts taken by a leader that dies before its next
  commit are lost: those requests run to their end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.state.wakeups import OnEvents, Watchers, WorkSignal, wait_events


class StaleEpochError(RuntimeError):
    """A commit from an epoch older than the store's: a fenced-off old leader."""


class StoreUnavailableError(ConnectionError):
    """The store did not answer a commit: it may or may not have landed, and resending it
    is safe (a commit landed twice is ignored by its id)."""


@dataclass(slots=True)
class StepCommit:
    """Everything one engine step changes, applied by `StateStore.commit` all or nothing."""

    epoch: int  # fencing token of the writer (from begin_epoch)
    commit_id: int  # strictly increasing per writer within an epoch
    meta: dict[str, str] = field(default_factory=dict)  # engine facts to upsert
    upsert_groups: dict[str, str] = field(default_factory=dict)  # request_id -> group JSON
    append_groups: dict[str, str] = field(default_factory=dict)  # request_id -> a JSON line
    delete_groups: list[str] = field(default_factory=list)  # finished request ids
    pending_step: str | None = None  # persistence.PendingStep, its result not yet applied
    clear_pending_step: bool = False
    events: list[tuple[str, str]] = field(default_factory=list)  # (request_id, event JSON)
    new_requests_consumed: list[str] = field(default_factory=list)  # taken from the queue
    taken_over: dict[str, str] = field(default_factory=dict)  # request_id -> source lane

    def __post_init__(self) -> None:
        if self.pending_step is not None and self.clear_pending_step:
            raise ValueError("set pending_step or clear_pending_step, not both")

    def touched_requests(self) -> list[str]:
        """Request ids whose events or submitted record this commit may change, first seen first."""
        ids = [rid for rid, _ in self.events] + self.delete_groups + self.new_requests_consumed
        return list(dict.fromkeys(ids))


@dataclass(slots=True)
class StoredState:
    """What a restarted leader reloads."""

    epoch: int
    last_commit_id: int  # id of the last applied commit (whatever its epoch)
    meta: dict[str, str]
    groups: dict[str, str]  # request_id -> group JSON lines
    pending_step: str | None


class StateStore(Protocol):
    """The scheduler's source of truth; see the module docstring for the shared rules."""

    lane_name: str  # "" for the store itself, else the name it was opened with by lane()

    def ping(self) -> bool:
        """True when the store answers (health checks)."""
        ...

    def begin_epoch(self, at_least: int = 0) -> int:
        """Increment the epoch (to ``at_least`` if that is more) and return it, fencing off
        every older writer."""
        ...

    def current_epoch(self) -> int: ...

    def load(self) -> StoredState:
        """One consistent snapshot of everything needed to resume."""
        ...

    def commit(self, commit: StepCommit) -> bool:
        """Apply one step atomically; False when ignored as a retry. Raises StaleEpochError,
        or StoreUnavailableError when the store cannot be reached."""
        ...

    def read_events(self, request_id: str, after: int = 0) -> list[tuple[int, str]]:
        """Events of a request with index > after (indices 1, 2, 3 ...), in order."""
        ...

    def delete_events(self, request_id: str) -> None:
        """Drop a request's output stream (and its record when its group is gone too)."""
        ...

    def submit_request(self, request_id: str, record: str) -> bool:
        """Queue a validated request; False when the request id already exists."""
        ...

    def pending_requests(self) -> list[tuple[str, str]]:
        """Submitted, not yet consumed requests as (request_id, record), in submission order."""
        ...

    def get_request(self, request_id: str) -> str | None: ...

    def request_abort(self, request_id: str) -> None:
        """Ask the leader, from any replica, to abort a request (unknown ids are dropped)."""
        ...

    def take_aborts(self, epoch: int) -> list[str]:
        """Drain the abort requests, oldest first, once each. Raises StaleEpochError."""
        ...

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block an idle leader until a submission or abort request arrives (True) or
        `timeout_s` passes (False; may come early). Consumes the signal."""
        ...

    def watch_events(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        """Pass the request's events to `on_events` as they are committed (None: some may
        have been missed, read them); any thread, so it must be quick and never block.
        Register before reading to miss nothing. Returns the unwatch function."""
        ...

    def wait_events(self, request_id: str, after: int, timeout_s: float) -> list[tuple[int, str]]:
        """`read_events(request_id, after)` as soon as it is not empty, or [] after timeout_s."""
        ...

    def lane(self, name: str) -> StateStore:
        """A view for one executor's engine: own groups, meta, pending step and commit
        order; shared epoch, submissions and events."""
        ...

    def lane_names(self) -> list[str]:
        """Lanes opened so far (and not dropped), for a new leader to recover."""
        ...

    def drop_lane(self, name: str) -> None:
        """Delete a retired lane's state."""
        ...


class StoreBehindError(ValueError):
    """A commit from an epoch the store never began: a caller that skipped begin_epoch(),
    or a store that lost its state (Redis restarted empty) under a running leader, whose
    term is then over."""


def check_epoch(commit_epoch: int, store_epoch: int) -> None:
    """Raise unless a commit's epoch is the store's current one."""
    if commit_epoch < store_epoch:
        raise StaleEpochError(f"commit from epoch {commit_epoch}, store is at {store_epoch}")
    if commit_epoch > store_epoch:
        raise StoreBehindError(
            f"commit from epoch {commit_epoch} but the store is at {store_epoch}: "
            "call begin_epoch() first (or the store lost its state)"
        )


class InMemoryStateStore:
    """Dicts and lists under one lock: the embedded default; lost when the process exits."""

    def __init__(self, finished_ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic):
        """Args:
        finished_ttl_s: how long a finished request's events and record outlive its group
            (as RedisStateStore's keys expire), so a long-running server does not keep them.
        """
        self._lock = threading.Lock()
        self._finished_ttl_s, self._clock = finished_ttl_s, clock
        self._expiring: dict[str, float] = {}  # finished request id -> when it goes, in order
        self._root = self  # lane views share the epoch, requests and events with it
        self.lane_name = ""
        self._lanes: dict[str, InMemoryStateStore] = {}
        self._epoch = 0
        self._last_commit = (0, 0)  # (epoch, commit_id) of the last applied commit
        self._meta: dict[str, str] = {}
        self._groups: dict[str, str] = {}
        self._pending_step: str | None = None
        self._events: dict[str, list[str]] = {}
        self._records: dict[str, str] = {}
        self._queue: dict[str, None] = {}  # an ordered set of request ids
        self._aborts: list[str] = []  # this and below: used on the root only
        self._work = WorkSignal()
        self._watchers = Watchers()

    def lane(self, name: str) -> InMemoryStateStore:
        """The view one executor's engine commits through: its own groups, meta, pending
        step and commit order; the epoch, submissions and events of the whole store."""
        if not name:
            raise ValueError("a lane needs a name")
        root = self._root
        with root._lock:
            if name not in root._lanes:
                view = InMemoryStateStore()
                view._lock, view._root = root._lock, root
                view._events, view._records, view._queue = root._events, root._records, root._queue
                view.lane_name = name
                root._lanes[name] = view
            return root._lanes[name]

    def lane_names(self) -> list[str]:
        with self._lock:
            return sorted(self._root._lanes)

    def drop_lane(self, name: str) -> None:
        """Forget a retired executor's lane (its groups were moved to other lanes first)."""
        with self._lock:
            self._root._lanes.pop(name, None)

    def ping(self) -> bool:
        return True

    def begin_epoch(self, at_least: int = 0) -> int:
        """Increment the epoch (to ``at_least`` if that is more); commits from older epochs
        are refused from now on."""
        with self._lock:
            self._root._epoch = max(self._root._epoch + 1, at_least)
            return self._root._epoch

    def current_epoch(self) -> int:
        with self._lock:
            return self._root._epoch

    def load(self) -> StoredState:
        with self._lock:
            return StoredState(
                epoch=self._root._epoch,
                last_commit_id=self._last_commit[1],
                meta=dict(self._meta),
                groups=dict(self._groups),
                pending_step=self._pending_step,
            )

    def commit(self, commit: StepCommit) -> bool:
        """Apply meta, groups, pending step, events and consumption under the lock.

        Every check runs before the first mutation, so a refused commit changes nothing.
        """
        with self._lock:
            check_epoch(commit.epoch, self._root._epoch)
            if (commit.epoch, commit.commit_id) <= self._last_commit:
                return False
            missing = commit.append_groups.keys() - self._groups.keys()
            missing -= commit.upsert_groups.keys()
            if missing:
                raise ValueError(f"appending to groups the store does not hold: {sorted(missing)}")
            self._last_commit = (commit.epoch, commit.commit_id)
            self._meta.update(commit.meta)
            self._groups.update(commit.upsert_groups)
            for rid, line in commit.append_groups.items():
                self._groups[rid] += "\n" + line
            for rid in commit.delete_groups:
                self._groups.pop(rid, None)
            for rid, source in commit.taken_over.items():
                view = self._root if source == "" else self._root._lanes.get(source)
                if view is not None and view is not self:
                    view._groups.pop(rid, None)
            if commit.pending_step is not None:
                self._pending_step = commit.pending_step
            elif commit.clear_pending_step:
                self._pending_step = None
            pushed = []
            for rid, event in commit.events:
                self._events.setdefault(rid, []).append(event)
                pushed.append((rid, len(self._events[rid]), event))
            for rid in commit.new_requests_consumed:
                self._queue.pop(rid, None)
            for rid in dict.fromkeys(commit.delete_groups + commit.new_requests_consumed):
                self._release_if_unused(rid)
            self._root._expire(commit.delete_groups)
            self._root._watchers.push(pushed)
            return True

    def _expire(self, finished: list[str]) -> None:
        """Root, under the lock: schedule the finished requests' events and records to go,
        and drop those whose time has come."""
        now = self._clock()
        for rid in finished:
            self._expiring.pop(rid, None)
            self._expiring[rid] = now + self._finished_ttl_s
        while self._expiring:
            rid, deadline = next(iter(self._expiring.items()))
            if deadline > now:
                break
            del self._expiring[rid]
            self._events.pop(rid, None)
            if not any(rid in lane._groups for lane in (self, *self._lanes.values())):
                self._records.pop(rid, None)

    def read_events(self, request_id: str, after: int = 0) -> list[tuple[int, str]]:
        with self._lock:
            events = self._events.get(request_id, [])
            start = max(after, 0)
            return list(enumerate(events[start:], start=start + 1))

    def delete_events(self, request_id: str) -> None:
        """Drop the output stream; drop the record too when nothing else refers to it."""
        with self._lock:
            self._events.pop(request_id, None)
            self._release_if_unused(request_id)

    def submit_request(self, request_id: str, record: str) -> bool:
        """Store the record and queue its id, unless the id is already known."""
        with self._lock:
            if request_id in self._records:
                return False
            self._root._expiring.pop(request_id, None)
            self._records[request_id] = record
            self._queue[request_id] = None
        self._root._work.notify()
        return True

    def pending_requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(rid, self._records[rid]) for rid in self._queue]

    def get_request(self, request_id: str) -> str | None:
        with self._lock:
            return self._records.get(request_id)

    def request_abort(self, request_id: str) -> None:
        with self._lock:
            self._root._aborts.append(request_id)
        self._root._work.notify()

    def take_aborts(self, epoch: int) -> list[str]:
        with self._lock:
            check_epoch(epoch, self._root._epoch)
            aborts, self._root._aborts = self._root._aborts, []
        return list(dict.fromkeys(aborts))

    def wait_for_work(self, timeout_s: float) -> bool:
        return self._root._work.wait(timeout_s)

    def watch_events(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        return self._root._watchers.add(request_id, on_events)

    def wait_events(self, request_id: str, after: int, timeout_s: float) -> list[tuple[int, str]]:
        return wait_events(self, request_id, after, timeout_s)

    def _release_if_unused(self, request_id: str) -> None:
        in_use = (
            request_id in self._queue or request_id in self._groups or request_id in self._events
        )
        if not in_use:
            self._records.pop(request_id, None)
