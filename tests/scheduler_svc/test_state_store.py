"""One suite for both StateStores: the in-process one and the one on a real redis-server."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable

import pytest
import redis

from pagedserve.settings import SchedulerOptions
from scheduler_svc.service import open_store
from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import (
    InMemoryStateStore,
    StaleEpochError,
    StateStore,
    StepCommit,
)
from tests.redis_server import delete_namespace

OpenStore = Callable[[str], RedisStateStore]


@pytest.fixture
def redis_store(redis_url: str) -> OpenStore:
    """Opens a RedisStateStore on the run's Redis under the given namespace."""
    return lambda namespace: RedisStateStore(redis_url, namespace=namespace)


def ev(i: int) -> str:
    return json.dumps({"index": i, "text": f"tok{i}"})


def test_empty_load(store: StateStore) -> None:
    state = store.load()
    assert (state.epoch, state.last_commit_id, state.meta, state.groups) == (0, 0, {}, {})
    assert state.pending_step is None
    assert store.current_epoch() == 0
    assert store.ping()
    assert store.read_events("nope") == []
    assert store.pending_requests() == []
    assert store.get_request("nope") is None


def test_begin_epoch_increments(store: StateStore) -> None:
    assert [store.begin_epoch(), store.begin_epoch(), store.begin_epoch()] == [1, 2, 3]
    assert store.current_epoch() == 3
    assert store.load().epoch == 3


def test_commit_round_trip(store: StateStore) -> None:
    epoch = store.begin_epoch()
    odd = 'ünï "cödé" \\ \n \u0000 🦙'  # what cjson has to carry through untouched
    assert store.commit(
        StepCommit(
            epoch,
            1,
            meta={"step_id": "1", "next_seq_id": "3"},
            upsert_groups={"a": '{"seqs": [0]}', "b": '{"seqs": [1, 2]}'},
            pending_step='{"step_id": 1}',
            events=[("a", ev(1)), ("b", ev(1)), ("a", ev(2)), ("a", odd)],
        )
    )
    state = store.load()
    assert (state.epoch, state.last_commit_id) == (epoch, 1)
    assert state.meta == {"step_id": "1", "next_seq_id": "3"}
    assert state.groups == {"a": '{"seqs": [0]}', "b": '{"seqs": [1, 2]}'}
    assert state.pending_step == '{"step_id": 1}'
    assert store.read_events("a") == [(1, ev(1)), (2, ev(2)), (3, odd)]
    assert store.read_events("b") == [(1, ev(1))]

    assert store.commit(
        StepCommit(
            epoch,
            2,
            meta={"step_id": "2"},
            upsert_groups={"b": '{"seqs": [2]}'},
            delete_groups=["a"],
            clear_pending_step=True,
            events=[("a", ev(3))],
        )
    )
    state = store.load()
    assert state.last_commit_id == 2
    assert state.meta == {"step_id": "2", "next_seq_id": "3"}
    assert state.groups == {"b": '{"seqs": [2]}'}
    assert state.pending_step is None
    assert [i for i, _ in store.read_events("a")] == [1, 2, 3, 4]


def test_appends_extend_a_group_and_refuse_a_group_not_held(store: StateStore) -> None:
    epoch = store.begin_epoch()
    odd = '{"text": "ünï\\n🦙"}'
    assert store.commit(StepCommit(epoch, 1, upsert_groups={"a": '{"v": 0}'}))
    assert store.commit(StepCommit(epoch, 2, append_groups={"a": '{"v": 1}'}))
    assert store.commit(
        StepCommit(
            epoch,
            3,
            upsert_groups={"b": '{"v": 0}'},
            append_groups={"a": odd, "b": '{"v": 1}'},
        )
    )
    assert store.load().groups == {"a": '{"v": 0}\n{"v": 1}\n' + odd, "b": '{"v": 0}\n{"v": 1}'}

    refused = StepCommit(epoch, 4, meta={"x": "1"}, append_groups={"a": "{}", "c": "{}"})
    with pytest.raises(ValueError, match="c"):
        store.commit(refused)
    state = store.load()
    assert (state.last_commit_id, state.meta, state.groups["a"].count("\n")) == (3, {}, 2)
    assert store.commit(StepCommit(epoch, 4, upsert_groups={"a": "{}"}))  # id 4 still free
    assert store.load().groups["a"] == "{}"


def test_a_group_taken_over_leaves_the_lane_it_moved_from(store: StateStore) -> None:
    """The commit that writes a moved group to its new lane deletes it, deltas and all,
    from the old one, so no two lanes ever hold it; the root store is a lane named ""."""
    epoch = store.begin_epoch()
    old, new = store.lane("a"), store.lane("b")
    assert old.commit(StepCommit(epoch, 1, upsert_groups={"g": "{}", "h": "{}"}))
    assert old.commit(StepCommit(epoch, 2, append_groups={"g": '{"v": 1}'}))
    assert store.commit(StepCommit(epoch, 1, upsert_groups={"r": "{}"}))
    assert new.commit(
        StepCommit(epoch, 1, upsert_groups={"g": "{}", "r": "{}"}, taken_over={"g": "a", "r": ""})
    )
    assert old.load().groups == {"h": "{}"}
    assert store.load().groups == {}
    assert new.load().groups == {"g": "{}", "r": "{}"}
    assert old.commit(StepCommit(epoch, 3, upsert_groups={"g": "{}"}))  # back: no stale deltas
    assert old.load().groups["g"] == "{}"


def test_the_in_process_store_forgets_finished_requests_after_their_ttl() -> None:
    now = [0.0]
    store = InMemoryStateStore(finished_ttl_s=60, clock=lambda: now[0])
    epoch = store.begin_epoch()
    for rid in ("a", "b"):
        assert store.submit_request(rid, "{}")
    lane = store.lane("x")
    assert lane.commit(StepCommit(epoch, 1, upsert_groups={"a": "{}", "b": "{}"}))
    events = [("a", "e1"), ("b", "e1")]
    assert lane.commit(StepCommit(epoch, 2, delete_groups=["a"], events=events))
    now[0] = 59
    assert lane.commit(StepCommit(epoch, 3, events=[("b", "e2")]))
    assert store.read_events("a") == [(1, "e1")] and store.get_request("a") == "{}"
    now[0] = 61
    assert lane.commit(StepCommit(epoch, 4, events=[("b", "e3")]))
    assert store.read_events("a") == [] and store.get_request("a") is None
    assert len(store.read_events("b")) == 3 and store.get_request("b") == "{}"  # still running


def test_pending_step_and_clear_together_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        StepCommit(1, 1, pending_step="{}", clear_pending_step=True)


def test_retried_commit_is_applied_once(store: StateStore) -> None:
    epoch = store.begin_epoch()
    commit = StepCommit(epoch, 7, meta={"step_id": "7"}, events=[("r", ev(1))])
    assert store.commit(commit)
    assert not store.commit(commit)
    assert not store.commit(StepCommit(epoch, 6, meta={"step_id": "6"}, events=[("r", ev(9))]))
    assert store.read_events("r") == [(1, ev(1))]
    assert store.load().meta == {"step_id": "7"}
    assert store.load().last_commit_id == 7


def test_stale_epoch_raises_and_changes_nothing(store: StateStore) -> None:
    old = store.begin_epoch()
    assert store.commit(StepCommit(old, 1, meta={"leader": "old"}, events=[("r", ev(1))]))
    new = store.begin_epoch()
    before = store.load()
    with pytest.raises(StaleEpochError):
        store.commit(
            StepCommit(
                old,
                2,
                meta={"leader": "old"},
                upsert_groups={"x": "{}"},
                delete_groups=["r"],
                pending_step="{}",
                events=[("r", ev(2))],
            )
        )
    assert store.load() == before
    assert store.read_events("r") == [(1, ev(1))]
    # The new leader may restart its ids: (epoch, commit_id) is what orders commits.
    assert store.commit(StepCommit(new, 1, meta={"leader": "new"}))
    with pytest.raises(StaleEpochError):
        store.commit(StepCommit(old, 99, meta={"leader": "old"}))
    assert store.load().meta == {"leader": "new"}
    assert store.load().last_commit_id == 1


def test_commit_from_a_future_epoch_is_refused(store: StateStore) -> None:
    epoch = store.begin_epoch()
    with pytest.raises(ValueError, match="begin_epoch"):
        store.commit(StepCommit(epoch + 1, 1, meta={"x": "1"}))
    assert store.load().meta == {}


def test_read_events_after(store: StateStore) -> None:
    epoch = store.begin_epoch()
    store.commit(StepCommit(epoch, 1, events=[("r", ev(i)) for i in range(1, 6)]))
    assert store.read_events("r", after=3) == [(4, ev(4)), (5, ev(5))]
    assert store.read_events("r", after=5) == []
    assert store.read_events("r", after=0) == store.read_events("r")
    store.commit(StepCommit(epoch, 2, events=[("r", ev(6))]))
    assert store.read_events("r", after=5) == [(6, ev(6))]


def test_submit_is_idempotent_and_queued_in_order(store: StateStore) -> None:
    assert store.submit_request("r1", '{"prompt": "a"}')
    assert store.submit_request("r2", '{"prompt": "b"}')
    assert not store.submit_request("r1", '{"prompt": "other"}')
    assert store.submit_request("r3", '{"prompt": "c"}')
    assert store.pending_requests() == [
        ("r1", '{"prompt": "a"}'),
        ("r2", '{"prompt": "b"}'),
        ("r3", '{"prompt": "c"}'),
    ]
    assert store.get_request("r1") == '{"prompt": "a"}'


def test_request_lifecycle_through_commits(store: StateStore) -> None:
    for rid in ("r1", "r2", "r3"):
        assert store.submit_request(rid, f'{{"id": "{rid}"}}')
    epoch = store.begin_epoch()
    store.commit(StepCommit(epoch, 1, upsert_groups={"r2": "{}"}, new_requests_consumed=["r2"]))
    assert [rid for rid, _ in store.pending_requests()] == ["r1", "r3"]
    assert not store.submit_request("r2", "{}")  # running
    assert store.get_request("r2") == '{"id": "r2"}'

    store.commit(StepCommit(epoch, 2, delete_groups=["r2"], events=[("r2", ev(1))]))
    assert not store.submit_request("r2", "{}")  # finished, its events still unread
    assert store.get_request("r2") == '{"id": "r2"}'
    store.delete_events("r2")
    assert store.read_events("r2") == []
    assert store.get_request("r2") is None
    assert store.submit_request("r2", '{"again": true}')  # gone: the id may be reused

    store.delete_events("r1")  # still queued: the record stays
    assert store.get_request("r1") == '{"id": "r1"}'
    assert [rid for rid, _ in store.pending_requests()] == ["r1", "r3", "r2"]


def test_delete_events_keeps_a_running_request(store: StateStore) -> None:
    store.submit_request("r", "{}")
    epoch = store.begin_epoch()
    store.commit(
        StepCommit(
            epoch, 1, upsert_groups={"r": "{}"}, new_requests_consumed=["r"], events=[("r", ev(1))]
        )
    )
    store.delete_events("r")
    assert store.read_events("r") == []
    assert store.get_request("r") == "{}"
    assert store.load().groups == {"r": "{}"}


def test_concurrent_commits_stay_consistent(store: StateStore) -> None:
    """Two writers draw ids from one counter; some land out of order and are ignored as retries.

    Whatever interleaving happens, every commit is all or nothing.
    """
    epoch = store.begin_epoch()
    ids = itertools.count(1)
    applied: dict[str, list[int]] = {"t0": [], "t1": []}

    def writer(name: str) -> None:
        for _ in range(150):
            i = next(ids)
            commit = StepCommit(
                epoch, i, meta={"step_id": str(i)}, upsert_groups={f"g{i}": name},
                events=[(name, ev(i))],
            )  # fmt: skip
            if store.commit(commit):
                applied[name].append(i)

    threads = [threading.Thread(target=writer, args=(name,)) for name in applied]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = sorted(applied["t0"] + applied["t1"])
    state = store.load()
    assert everything and state.last_commit_id == everything[-1]
    assert state.meta == {"step_id": str(everything[-1])}
    assert state.groups == {f"g{i}": name for name, got in applied.items() for i in got}
    for name, got in applied.items():
        assert store.read_events(name) == [(n, ev(i)) for n, i in enumerate(got, start=1)]


@pytest.mark.redis
def test_redis_namespaces_are_isolated(
    namespace: str, redis_store: OpenStore, redis_client: redis.Redis
) -> None:
    other_ns = f"{namespace}-other"
    store, other = redis_store(namespace), redis_store(other_ns)
    try:
        store.submit_request("r", "{}")
        epoch = store.begin_epoch()
        store.commit(StepCommit(epoch, 1, meta={"k": "v"}, events=[("r", ev(1))]))
        assert other.current_epoch() == 0
        assert other.load().meta == {}
        assert other.read_events("r") == []
        assert other.pending_requests() == []
        assert other.submit_request("r", "{}")
        client = redis_client
        assert all(key.startswith(f"{namespace}:") for key in client.scan_iter(f"{namespace}:*"))
        assert client.exists(f"{namespace}:meta", f"{namespace}:events:r") == 2
    finally:
        delete_namespace(redis_client, other_ns)


@pytest.mark.redis
def test_redis_second_store_sees_the_first_ones_state(
    namespace: str, redis_store: OpenStore
) -> None:
    """What a scheduler restarted after kill -9 sees: everything committed, nothing else."""
    first = redis_store(namespace)
    first.submit_request("r1", '{"p": 1}')
    first.submit_request("r2", '{"p": 2}')
    epoch = first.begin_epoch()
    first.commit(
        StepCommit(
            epoch,
            5,
            meta={"step_id": "5"},
            upsert_groups={"r1": '{"g": 1}'},
            pending_step='{"step_id": 5}',
            events=[("r1", ev(1))],
            new_requests_consumed=["r1"],
        )
    )
    restarted = redis_store(namespace)
    state = restarted.load()
    assert (state.epoch, state.last_commit_id) == (epoch, 5)
    assert state.meta == {"step_id": "5"}
    assert state.groups == {"r1": '{"g": 1}'}
    assert state.pending_step == '{"step_id": 5}'
    assert restarted.read_events("r1") == [(1, ev(1))]
    assert restarted.pending_requests() == [("r2", '{"p": 2}')]
    assert restarted.get_request("r1") == '{"p": 1}'
    new_epoch = restarted.begin_epoch()
    assert restarted.commit(StepCommit(new_epoch, 1, clear_pending_step=True))
    with pytest.raises(StaleEpochError):
        first.commit(StepCommit(epoch, 6, meta={"step_id": "6"}))
    assert first.load().pending_step is None


@pytest.mark.redis
def test_redis_group_written_by_an_older_version_still_reads_and_grows(
    namespace: str, redis_store: OpenStore, redis_client: redis.Redis
) -> None:
    """Older versions appended deltas to the hash value itself; after an upgrade such a
    group reads whole, takes deltas, and a snapshot or a delete clears both places."""
    store, client = redis_store(namespace), redis_client
    client.hset(f"{namespace}:groups", mapping={"old": '{"v": 0}\n{"v": 1}', "gone": "{}"})
    epoch = store.begin_epoch()
    assert store.commit(StepCommit(epoch, 1, append_groups={"old": '{"v": 2}'}))
    assert store.load().groups["old"] == '{"v": 0}\n{"v": 1}\n{"v": 2}'
    assert store.commit(StepCommit(epoch, 2, upsert_groups={"old": '{"v": 3}'}))
    assert store.commit(StepCommit(epoch, 3, append_groups={"old": '{"v": 4}'}))
    assert store.commit(StepCommit(epoch, 4, delete_groups=["gone"]))
    assert store.load().groups == {"old": '{"v": 3}\n{"v": 4}'}
    assert store.commit(StepCommit(epoch, 5, delete_groups=["old"]))
    assert store.load().groups == {}
    assert not list(client.scan_iter(match=f"{namespace}:deltas:*"))


@pytest.mark.redis
def test_redis_load_falls_between_two_commits(namespace: str, redis_store: OpenStore) -> None:
    """Snapshots and deltas are separate keys: a load racing a writer still sees, for every
    commit it counts, that commit's delta and no later one."""
    store = redis_store(namespace)
    epoch = store.begin_epoch()
    assert store.commit(StepCommit(epoch, 1, upsert_groups={"g": "{}"}))
    done = threading.Event()

    def writer() -> None:
        for i in range(2, 200):
            store.commit(StepCommit(epoch, i, append_groups={"g": "{}"}))
            time.sleep(0.001)  # room for loads to finish between commits, as well as to race
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    loads = 0
    while not done.is_set() or loads == 0:
        state = store.load()
        assert state.groups["g"].count("\n") == state.last_commit_id - 1
        loads += 1
    thread.join()
    assert loads > 1


@pytest.mark.redis
def test_redis_drop_lane_deletes_its_keys(
    namespace: str, redis_store: OpenStore, redis_client: redis.Redis
) -> None:
    root = redis_store(namespace)
    lane = root.lane("x")
    epoch = root.begin_epoch()
    assert lane.commit(StepCommit(epoch, 1, upsert_groups={"g": "{}"}, pending_step="{}"))
    assert lane.commit(StepCommit(epoch, 2, append_groups={"g": "{}"}))
    root.drop_lane("x")
    assert root.lane_names() == []
    assert not list(redis_client.scan_iter(match=f"{namespace}:lane:x:*"))


@pytest.mark.redis
@pytest.mark.parametrize("finished_ttl_s", [None, 90.0])
def test_redis_finished_request_keys_expire(
    namespace: str, redis_url: str, redis_client: redis.Redis, finished_ttl_s: float | None
) -> None:
    """After an hour by default, or --finished-ttl as the service opens its store."""
    options = SchedulerOptions(state_store=redis_url, namespace=namespace)
    if finished_ttl_s is not None:
        options = dataclasses.replace(options, finished_ttl_s=finished_ttl_s)
    store = open_store(options)
    store.submit_request("r", "{}")
    epoch = store.begin_epoch()
    store.commit(StepCommit(epoch, 1, upsert_groups={"r": "{}"}, new_requests_consumed=["r"]))
    store.commit(StepCommit(epoch, 2, delete_groups=["r"], events=[("r", ev(1))]))
    store.close()
    ttl_ms = (finished_ttl_s or 3600) * 1000
    for key in (f"{namespace}:events:r", f"{namespace}:request:r"):
        assert ttl_ms - 60_000 < redis_client.pttl(key) <= ttl_ms


def test_aborts_are_taken_once_in_order(store: StateStore) -> None:
    epoch = store.begin_epoch()
    assert store.take_aborts(epoch) == []
    for rid in ("a", "b", "a", "c"):
        store.request_abort(rid)
    assert store.take_aborts(epoch) == ["a", "b", "c"]
    assert store.take_aborts(epoch) == []


def test_take_aborts_is_fenced(store: StateStore) -> None:
    """A deposed leader must not swallow the aborts its successor has to apply."""
    old = store.begin_epoch()
    store.request_abort("r")
    new = store.begin_epoch()
    with pytest.raises(StaleEpochError):
        store.take_aborts(old)
    with pytest.raises(ValueError, match="begin_epoch"):
        store.take_aborts(new + 1)
    assert store.take_aborts(new) == ["r"]


def test_wait_for_work_wakes_on_submissions_and_aborts(store: StateStore) -> None:
    assert not store.wait_for_work(0.05)
    store.submit_request("r1", "{}")
    store.submit_request("r2", "{}")
    assert store.wait_for_work(0.05)
    assert not store.wait_for_work(0.05)  # one wake for both: the leader reads the whole queue
    assert not store.submit_request("r1", "{}") and not store.wait_for_work(0.05)
    store.request_abort("r1")
    assert store.wait_for_work(0)

    later = threading.Timer(0.1, store.submit_request, args=("r3", "{}"))
    later.start()
    start = time.monotonic()
    assert store.wait_for_work(2.0)
    assert time.monotonic() - start < 1.0
    later.join()  # before the fixture closes the store under its call


def test_wait_events(store: StateStore) -> None:
    epoch = store.begin_epoch()
    store.commit(StepCommit(epoch, 1, events=[("r", ev(1)), ("r", ev(2))]))
    assert store.wait_events("r", 0, 5.0) == [(1, ev(1)), (2, ev(2))]  # already there
    start = time.monotonic()
    assert store.wait_events("r", 2, 0.1) == []
    assert time.monotonic() - start >= 0.1

    commit = StepCommit(epoch, 2, events=[("other", ev(1)), ("r", ev(3))])
    later = threading.Timer(0.2, store.commit, args=(commit,))
    later.start()
    start = time.monotonic()
    assert store.wait_events("r", 2, 5.0) == [(3, ev(3))]
    assert time.monotonic() - start < 1.0
    later.join()


class Inbox:
    """A watch callback that keeps what it was handed."""

    def __init__(self) -> None:
        self.got: list[list[tuple[int, str]] | None] = []
        self.arrived = threading.Event()

    def __call__(self, events: list[tuple[int, str]] | None) -> None:
        self.got.append(events)
        self.arrived.set()

    def wait(self, timeout_s: float) -> list[list[tuple[int, str]] | None]:
        """What arrived within `timeout_s` (waiting only for the first), emptying the inbox."""
        self.arrived.wait(timeout_s)
        time.sleep(0.05)  # let the rest of one commit's pushes land
        got, self.got = self.got, []
        self.arrived.clear()
        return got


def test_watchers_get_the_events_of_their_request(store: StateStore) -> None:
    epoch = store.begin_epoch()
    a, b = Inbox(), Inbox()
    unwatch_a = store.watch_events("a", a)
    store.watch_events("b", b)
    odd = 'ünï "cödé" \\ / \n \u0000 🦙'
    store.commit(StepCommit(epoch, 1, events=[("a", ev(1)), ("c", ev(1)), ("a", odd)]))
    assert a.wait(2.0) == [[(1, ev(1)), (2, odd)]]  # one call per commit
    assert store.read_events("a") == [(1, ev(1)), (2, odd)]
    assert b.wait(0.1) == []

    unwatch_a()
    store.commit(StepCommit(epoch, 2, upsert_groups={"b": "{}"}))  # no events: no call
    assert b.wait(0.1) == []
    store.commit(StepCommit(epoch, 3, events=[("a", ev(3)), ("b", ev(1))]))
    assert b.wait(2.0) == [[(1, ev(1))]]
    assert a.wait(0.1) == []
    # A refused commit (and a retry) pushes nothing.
    assert not store.commit(StepCommit(epoch, 3, events=[("b", ev(2))]))
    store.begin_epoch()
    with pytest.raises(StaleEpochError):
        store.commit(StepCommit(epoch, 4, events=[("b", ev(2))]))
    assert b.wait(0.1) == []


def test_lane_commits_reach_watchers_of_the_whole_store(store: StateStore) -> None:
    """Followers watch a request wherever it runs: lanes share events, aborts and wakes."""
    lane = store.lane("executor-0")
    inbox = Inbox()
    store.watch_events("r", inbox)
    epoch = lane.begin_epoch()
    lane.commit(StepCommit(epoch, 1, events=[("r", ev(1))]))
    assert inbox.wait(2.0) == [[(1, ev(1))]]
    assert store.wait_events("r", 0, 1.0) == [(1, ev(1))]
    lane.request_abort("r")
    assert store.wait_for_work(0.5)
    assert store.take_aborts(epoch) == ["r"]


@pytest.mark.redis
def test_redis_listener_reconnects_and_tells_every_watcher(
    namespace: str, redis_store: OpenStore, redis_client: redis.Redis
) -> None:
    """Pub/sub loses what is published while disconnected: after a reconnect every watcher
    hears that it may have missed events."""
    store = redis_store(namespace)
    client = redis_client
    try:
        epoch = store.begin_epoch()
        inbox = Inbox()
        store.watch_events("r", inbox)
        listener = [c for c in client.client_list() if c["name"] == f"listener:{namespace}:events"]
        assert len(listener) == 1
        client.client_kill_filter(_id=listener[0]["id"])
        assert inbox.wait(5.0) == [None]
        store.commit(StepCommit(epoch, 1, events=[("r", ev(1))]))
        assert inbox.wait(2.0) == [[(1, ev(1))]]
    finally:
        store.close()
        client.close()
