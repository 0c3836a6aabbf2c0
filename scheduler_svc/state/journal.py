"""Writes every engine step to the StateStore and rebuilds the engine from it after a
restart, so a scheduler killed at any moment finishes every request it had accepted.

One commit per step, before the executor call:

    schedule(N) ─► commit: step N's decisions, step N by reference (pending), and the
                   tokens, finished groups and stream events of step N-1 ─► Execute(N)

The results of step N-1 can wait for step N's commit because step N-1 is recorded as
pending until then: a restart rebuilds the pending step from the groups of the same commit
and sends it again, and the executor, which applies a step id once, answers with the
stored result. When the engine goes idle it
flushes the last results with the pending step cleared.

A group that only grew since its last write (the common decode step) is written as a
delta appended to its stored value. It is written whole again when it changed in any
other way, or once it has at least `COMPACT_AFTER` deltas and they add up to the size of
its last whole write (at most `MAX_DELTAS`): a long sequence's whole write costs as much
as hundreds of deltas, and this way whole writes cost no more than the deltas do, while
a stored value stays under twice the size of the group's whole state.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from pagedserve.settings import crash_point
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import SequenceGroup, SequenceStatus
from scheduler_svc.state.persistence import (
    RestoredGroup,
    StoredMark,
    group_delta,
    group_from_json,
    group_to_json,
    stored_mark,
)
from scheduler_svc.state.state_store import (
    StateStore,
    StepCommit,
    StoredState,
    StoreUnavailableError,
)
from scheduler_svc.state.streams import RequestDelta

COMPACT_AFTER = 32  # deltas a group takes before it may be written whole again
MAX_DELTAS = 1024  # deltas after which it is, whatever their size: bounds the parsing on load
RETRY_MIN_S, RETRY_MAX_S = 0.05, 1.0  # backoff of a commit resent to an unreachable store

log = structlog.get_logger(__name__)


class Journal:
    """The engine's link to its StateStore: commits, fencing epoch, crash points for tests."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.epoch = 0
        self._commit_ids = itertools.count(1)
        self._dirty: dict[str, SequenceGroup] = {}
        self._deleted: list[str] = []
        self._consumed: list[str] = []
        self._taken: dict[str, str] = {}  # request id -> the store lane it moves from
        self._events: list[RequestDelta] = []  # deferred to the next commit
        self._marks: dict[str, StoredMark] = {}  # what the store holds of each group
        self._crash_at = crash_point()
        self._num_steps = 0
        self.halt = threading.Event()  # set when the term ends: stop resending commits
        self._landing: Future[None] | None = None  # a commit on its way (commit, wait=False)
        self._writer: ThreadPoolExecutor | None = None
        self._next: list[Future[None]] = []  # see next_landing
        self.committed_at = 0.0  # time.monotonic() of the last commit's start
        self._changes_committed: int | None = None  # num_table_changes at the last commit

    def begin(self, epoch: int | None = None) -> StoredState:
        """Read back what the last leader left, under ``epoch`` (the caller's lease) or a
        new fencing epoch taken here."""
        self.epoch = self.store.begin_epoch() if epoch is None else epoch
        state = self.store.load()
        self._marks.clear()  # the first write of each group after a restart is whole
        self._changes_committed = None
        self._commit_ids = itertools.count(state.last_commit_id + 1)
        return state

    def check_storable(self, group: SequenceGroup) -> None:
        """Raise ValueError for a group whose state cannot be written (a commit refusing it
        would stop every request of the engine, now and at each restart)."""
        try:
            group_to_json(group, _queue_of(group), {})
        except Exception as e:
            raise ValueError(f"the request cannot be journaled: {e}") from None

    def touch(self, group: SequenceGroup) -> None:
        self._dirty[group.request_id] = group

    def consumed(self, request_id: str) -> None:
        """A submitted request became a group: it leaves the submission queue."""
        self._consumed.append(request_id)

    def take_over(self, request_id: str, source: str) -> None:
        """A group moves here from the store lane ``source``: the next commit deletes it
        there in the same transaction that writes it here."""
        if source != self.store.lane_name:
            self._taken[request_id] = source

    def remove(self, request_id: str) -> None:
        self._dirty.pop(request_id, None)
        self._deleted.append(request_id)

    def defer(self, events: list[RequestDelta]) -> None:
        """Hold a step's stream events for the next commit."""
        self._events += events

    def next_landing(self) -> Future[None]:
        """A future the next commit settles, as its own: for a step's events deferred to
        it (LLMEngine's commit interval)."""
        future: Future[None] = Future()
        self._next.append(future)
        return future

    @property
    def has_events(self) -> bool:
        """Stream events wait for the next commit."""
        return bool(self._events)

    @property
    def has_deferred(self) -> bool:
        return bool(self._dirty or self._deleted or self._consumed or self._events or self._taken)

    def can_write_some(self, scheduler: Scheduler) -> bool:
        """Whether a commit may write some of the touched groups and leave the others for a
        later one: not once a table changed other than by taking free blocks since the
        last commit (BlockManager.num_table_changes). A group left behind would be
        restored with a table claiming a block it gave back, which another group written
        here may hold, or would go on writing into a block that a newer table shares."""
        return scheduler.block_manager.num_table_changes == self._changes_committed

    def commit(
        self,
        scheduler: Scheduler,
        meta: dict[str, str],
        pending_step: str | None = None,
        wait: bool = True,
        groups: set[str] | None = None,
    ) -> Future[None] | None:
        """Write every touched group, removal and deferred event in one atomic commit; of
        the touched groups only those of ``groups`` when given (see ``can_write_some``),
        and those of requests leaving the submission queue or another lane, the others
        staying touched for the next.

        Commits land one at a time, in order. With ``wait`` False the store's round trip
        is left to a writer thread, and the future it returns says when the commit landed
        (or why it did not): the caller publishes the commit's events only then, and the
        next commit, or ``settle``, waits for it and raises what it raised.
        """
        upserts: dict[str, str] = {}
        appends: dict[str, str] = {}
        marks: dict[str, StoredMark] = {}
        dirty = self._dirty
        if groups is not None:
            assert self.can_write_some(scheduler), "a table changed: write every group"
            # A request leaves the submission queue, or the lane it moved from, only in
            # the commit that writes its group: else a crash between would lose it.
            wanted = groups.union(self._consumed, self._taken)
            dirty = {rid: self._dirty[rid] for rid in wanted if rid in self._dirty}
        for rid, group in dirty.items():
            queue, tables = _queue_of(group), _tables_of(scheduler, group)
            mark = self._marks.get(rid)
            delta = None
            if mark is not None and not _compaction_due(mark):
                delta = group_delta(group, queue, tables, mark)
            if delta is None:
                upserts[rid] = whole = group_to_json(group, queue, tables)
                marks[rid] = stored_mark(group, tables, whole_chars=len(whole))
            else:
                appends[rid] = delta
                marks[rid] = stored_mark(
                    group,
                    tables,
                    mark.num_deltas + 1,
                    mark.whole_chars,
                    mark.delta_chars + len(delta),
                )
        commit = StepCommit(
            epoch=self.epoch,
            commit_id=next(self._commit_ids),
            meta=meta,
            upsert_groups=upserts,
            append_groups=appends,
            delete_groups=list(self._deleted),
            pending_step=pending_step,
            clear_pending_step=pending_step is None,
            events=[(e.request_id, e.to_json()) for e in self._events],
            new_requests_consumed=list(self._consumed),
            taken_over=dict(self._taken),
        )
        self.settle()
        self.committed_at = time.monotonic()
        waiting, self._next = self._next, []
        landing = None
        if wait:
            try:
                self._send(commit)
            except BaseException as e:
                _settle(waiting, e)
                raise
            _settle(waiting, None)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="journal")
            landing = self._landing = self._writer.submit(self._send, commit)
            if waiting:
                landing.add_done_callback(lambda done: _settle(waiting, done.exception()))
        self._marks.update(marks)
        for rid in self._deleted:
            self._marks.pop(rid, None)
        if dirty is self._dirty:
            dirty.clear()
        else:
            for rid in dirty:
                del self._dirty[rid]
        self._changes_committed = scheduler.block_manager.num_table_changes
        self._deleted.clear()
        self._consumed.clear()
        self._taken.clear()
        self._events.clear()
        return landing

    def settle(self) -> None:
        """Wait for the commit on its way, if any; raise what it raised."""
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.result()

    def _send(self, commit: StepCommit) -> None:
        """Commit, resending while the store is unreachable (a commit that landed twice is
        ignored) until it answers or the term ends (``halt``): the step waits, nothing is
        lost, and the engine goes on by itself when the store is back."""
        delay = RETRY_MIN_S
        while True:
            try:
                self.store.commit(commit)
                return
            except StoreUnavailableError as e:
                if delay == RETRY_MIN_S:
                    log.warning("state store unreachable; resending the commit", error=str(e))
                if self.halt.wait(delay):
                    raise
                delay = min(delay * 2, RETRY_MAX_S)

    def crash_if_asked(self, where: str, settle: Callable[[], object] | None = None) -> None:
        """Test hook: die like kill -9 at a named step boundary (PAGEDSERVE_CRASH_AT) of
        step N or, for a boundary that a step may pass by (a commit shared with later
        calls), of the first step after N to reach it; after ``settle()`` (waiting for
        the executor to apply the step sent)."""
        if where == "before_persist":
            self._num_steps += 1
        crash_at = self._crash_at
        if crash_at is not None and crash_at[0] == where and crash_at[1] <= self._num_steps:
            if settle is not None:
                settle()
            os.kill(os.getpid(), signal.SIGKILL)


def _settle(futures: list[Future[None]], error: BaseException | None) -> None:
    """Give each of ``futures`` the outcome of the commit they waited for."""
    for future in futures:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _compaction_due(mark: StoredMark) -> bool:
    """Whether the group's next write is whole (see the module's docstring)."""
    if mark.num_deltas >= MAX_DELTAS:
        return True
    return mark.num_deltas >= COMPACT_AFTER and mark.delta_chars >= mark.whole_chars


def _queue_of(group: SequenceGroup) -> str:
    if len(group.seqs) == 1:
        return _QUEUE_OF_STATUS.get(group.seqs[0].status, "waiting")
    statuses = {seq.status for seq in group.seqs}
    if SequenceStatus.RUNNING in statuses:
        return "running"
    if SequenceStatus.SWAPPED in statuses:
        return "swapped"
    return "waiting"


_QUEUE_OF_STATUS = {SequenceStatus.RUNNING: "running", SequenceStatus.SWAPPED: "swapped"}


def _tables_of(scheduler: Scheduler, group: SequenceGroup) -> dict[int, tuple[list[int], int]]:
    bm = scheduler.block_manager
    return {
        seq.seq_id: (list(bm.block_tables[seq.seq_id]), bm.num_slots(seq))
        for seq in group.seqs
        if seq.seq_id in bm.block_tables
    }


def restore_groups(
    scheduler: Scheduler, state: StoredState, kv_lost: bool
) -> tuple[list[RestoredGroup], dict[str, str]]:
    """Put the persisted groups back in their queues and their tables in the pools.

    When the executor lost its pools (``kv_lost``), running and swapped groups go back
    to waiting and will be recomputed from their tokens.

    Returns the restored groups, and the groups that would not restore (request id ->
    why): quarantined, so that one bad record never stops the recovery of the others.
    """
    parsed, broken = [], {}
    for request_id, text in state.groups.items():
        try:
            parsed.append(group_from_json(text))
        except Exception as e:
            broken[request_id] = repr(e)
    restored = []
    for r in sorted(parsed, key=lambda r: r.group.arrival_time):
        try:
            _restore_group(scheduler, r, kv_lost)
        except Exception as e:
            broken[r.group.request_id] = repr(e)
            continue
        restored.append(r)
    scheduler.block_manager.check_integrity()
    return restored, broken


def _restore_group(scheduler: Scheduler, r: RestoredGroup, kv_lost: bool) -> None:
    """Queue one restored group with its tables claimed in the pools, all or nothing."""
    if r.queue not in ("waiting", "running", "swapped"):
        raise ValueError(f"unknown queue {r.queue!r}")
    bm = scheduler.block_manager
    if kv_lost and r.queue != "waiting":
        reset_for_recompute(r.group)
        r.queue = "waiting"
    else:
        claimed = [seq for seq in r.group.seqs if seq.seq_id in r.block_tables]
        for seq in claimed:
            table, _ = r.block_tables[seq.seq_id]
            if seq.seq_id in bm.block_tables or not bm.fits_pool(table, r.queue == "swapped"):
                raise ValueError(f"sequence {seq.seq_id}: table {table} does not fit the pool")
        for seq in claimed:
            table, num_slots = r.block_tables[seq.seq_id]
            bm.restore(seq, table, num_slots, on_cpu=r.queue == "swapped")
    getattr(scheduler, r.queue).append(r.group)


def reset_for_recompute(group: SequenceGroup) -> None:
    """The group's K/V is gone: its unfinished sequences wait to be computed again."""
    for seq in group.seqs:
        if not seq.status.is_finished:
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0


def orphaned_groups(state: StoredState) -> list[SequenceGroup]:
    """The groups of a lane whose executor is gone, reset to be recomputed elsewhere; one
    whose stored state does not parse is logged and left behind."""
    groups = []
    for request_id, text in state.groups.items():
        try:
            group = group_from_json(text).group
        except Exception as e:
            log.error("request quarantined", request_id=request_id, why=repr(e))
            continue
        reset_for_recompute(group)
        groups.append(group)
    return sorted(groups, key=lambda g: g.arrival_time)
