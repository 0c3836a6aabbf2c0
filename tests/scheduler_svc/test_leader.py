"""Leader election on a real redis-server: one holder at a time, a new epoch per term, and
fencing that refuses a leader who was paused past its lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import redis

from scheduler_svc.state.leader import LeaderLease, LeaseKeeper, LocalLease, lease_for
from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import InMemoryStateStore, StaleEpochError, StepCommit
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

TTL = 0.5


@pytest.fixture
def store(redis_url: str, namespace: str) -> Iterator[RedisStateStore]:
    s = RedisStateStore(redis_url, namespace=namespace)
    yield s
    s.close()


def test_one_of_many_contenders_acquires(store: RedisStateStore) -> None:
    leases = [LeaderLease(store, TTL) for _ in range(4)]
    barrier = threading.Barrier(len(leases))
    epochs: list[int | None] = [None] * len(leases)

    def contend(i: int) -> None:
        barrier.wait()
        epochs[i] = leases[i].acquire()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, e in enumerate(epochs) if e is not None]
    assert len(winners) == 1 and epochs[winners[0]] == 1
    assert {lease.holder() for lease in leases} == {leases[winners[0]].replica_id}


def test_each_acquisition_takes_a_new_epoch(store: RedisStateStore) -> None:
    a, b = LeaderLease(store, TTL, "a"), LeaderLease(store, TTL, "b")
    assert a.acquire() == 1
    assert b.acquire() is None
    assert a.acquire() == 2  # already ours (a retry whose reply was lost): a new term anyway
    assert a.release()
    assert b.acquire() == 3
    assert store.current_epoch() == 3
    assert b.holder() == "b"


def test_renew_fails_after_expiry_and_after_takeover(store: RedisStateStore) -> None:
    a, b = LeaderLease(store, TTL, "a"), LeaderLease(store, TTL, "b")
    assert a.acquire() is not None
    assert a.renew()
    time.sleep(TTL * 1.3)
    assert a.holder() is None
    assert not a.renew()  # expired: renewing must not resurrect it
    assert b.acquire() is not None
    assert not a.renew()
    assert b.renew()
    assert a.holder() == "b"


def test_release_deletes_only_our_own_lease(store: RedisStateStore) -> None:
    a, b = LeaderLease(store, TTL, "a"), LeaderLease(store, TTL, "b")
    assert not a.release()  # nobody holds it
    assert a.acquire() is not None
    assert not b.release()
    assert b.holder() == "a"
    assert a.release()
    assert a.holder() is None
    assert b.acquire() is not None
    assert not a.release()
    assert a.holder() == "b"


def test_lease_lives_under_the_namespace(
    store: RedisStateStore, namespace: str, redis_url: str
) -> None:
    lease = LeaderLease(store, TTL, "a")
    lease.acquire()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.get(f"{namespace}:leader") == "a"
    assert 0 < client.pttl(f"{namespace}:leader") <= TTL * 1000
    client.close()


def test_standby_takes_over_within_the_ttl(store: RedisStateStore) -> None:
    holder = LeaderLease(store, TTL, "holder")
    standby = LeaseKeeper(LeaderLease(store, TTL, "standby"))
    acquired_at = time.monotonic()
    assert holder.acquire() == 1  # and never renewed: the holder died
    assert standby.wait_for_leadership() == 2
    waited = time.monotonic() - acquired_at
    assert TTL * 0.9 <= waited <= TTL * 1.25 + 0.3  # the TTL plus one poll (ttl/4)
    assert standby.is_leader
    standby.step_down()


def test_a_renewing_leader_keeps_the_standby_out(store: RedisStateStore) -> None:
    # A longer lease than the other tests': under the suite's load a renewal thread once
    # waited more than 0.5 s for a core, and the standby rightly took the lapsed lease.
    ttl = 4 * TTL
    leader = LeaseKeeper(LeaderLease(store, ttl, "leader"))
    standby = LeaseKeeper(LeaderLease(store, ttl, "standby"))
    assert leader.wait_for_leadership() == 1
    stop = threading.Event()
    threading.Timer(ttl * 2, stop.set).start()
    assert standby.wait_for_leadership(stop) is None
    assert leader.is_leader
    leader.step_down()  # releases: no need to wait for the TTL
    start = time.monotonic()
    assert standby.wait_for_leadership() == 2
    assert time.monotonic() - start < ttl / 2
    standby.step_down()


def test_keeper_reports_a_taken_lease_once(store: RedisStateStore, redis_url: str) -> None:
    lost: list[float] = []
    keeper = LeaseKeeper(LeaderLease(store, TTL, "a"), on_lost=lambda: lost.append(1))
    assert keeper.wait_for_leadership() == 1
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.set(f"{store.namespace}:leader", "usurper", px=int(TTL * 4000))
    client.close()
    deadline = time.monotonic() + TTL
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(TTL)  # no second report
    assert lost == [1]
    assert not keeper.is_leader
    keeper.step_down()
    assert LeaderLease(store, TTL).holder() == "usurper"  # stepping down released nothing


def test_keeper_can_lead_again_after_a_loss(store: RedisStateStore, redis_url: str) -> None:
    lost = threading.Event()
    keeper = LeaseKeeper(LeaderLease(store, TTL, "a"), on_lost=lost.set)
    assert keeper.wait_for_leadership() == 1
    other = LeaderLease(store, TTL, "b")
    redis.Redis.from_url(redis_url).delete(f"{store.namespace}:leader")
    assert other.acquire() == 2
    assert lost.wait(TTL * 2)
    keeper.step_down()
    assert other.release()
    assert keeper.wait_for_leadership() == 3
    keeper.step_down()


def test_old_leader_epoch_is_refused_after_a_takeover(store: RedisStateStore) -> None:
    """What fencing is for: the lease lapsed under a paused leader and another took over."""
    old, new = LeaderLease(store, TTL, "old"), LeaderLease(store, TTL, "new")
    old_epoch = old.acquire()
    assert old_epoch is not None
    assert store.commit(StepCommit(old_epoch, 1, meta={"leader": "old"}))
    time.sleep(TTL * 1.3)  # paused: no renewal
    new_epoch = new.acquire()
    assert new_epoch == old_epoch + 1
    assert store.commit(StepCommit(new_epoch, 1, meta={"leader": "new"}))
    assert not old.renew()
    with pytest.raises(StaleEpochError):
        store.commit(StepCommit(old_epoch, 2, meta={"leader": "old"}, events=[("r", "{}")]))
    with pytest.raises(StaleEpochError):
        store.take_aborts(old_epoch)
    assert store.load().meta == {"leader": "new"}
    assert store.read_events("r") == []


_PAUSABLE_LEADER = """
import sys, threading, time
from pagedserve.log import configure_logging
from scheduler_svc.state.leader import LeaderLease, LeaseKeeper
from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import StaleEpochError, StepCommit

configure_logging()  # to stderr: a log line written beside a marker could split it
store = RedisStateStore(sys.argv[1], namespace=sys.argv[2])
lost = threading.Event()
keeper = LeaseKeeper(LeaderLease(store, float(sys.argv[3]), "paused"), on_lost=lost.set)
epoch = keeper.wait_for_leadership()
print("@ leading", epoch, flush=True)
for commit_id in range(1, 100000):
    try:
        store.commit(StepCommit(epoch, commit_id, meta={"leader": "paused"}))
    except StaleEpochError:
        print("@ refused", flush=True)
        break
    time.sleep(0.02)
print("@", "lost" if lost.wait(5) else "never-lost", keeper.is_leader, flush=True)
"""


def test_paused_leader_wakes_up_fenced_and_steps_down(
    store: RedisStateStore, redis_url: str
) -> None:
    """SIGSTOP the leader process past its TTL, let a standby take over, SIGCONT it."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    args = [sys.executable, "-c", _PAUSABLE_LEADER, redis_url, store.namespace, str(TTL)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert next(_marked(iter(proc.stdout.readline, ""))) == "leading 1"
        time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        standby = LeaseKeeper(LeaderLease(store, TTL, "standby"))
        assert standby.wait_for_leadership() == 2
        assert store.commit(StepCommit(2, 1, meta={"leader": "standby"}))
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert list(_marked(out.splitlines())) == ["refused", "lost False"]
        assert store.load().meta == {"leader": "standby"}
        assert standby.is_leader
        standby.step_down()
    finally:
        proc.kill()
        proc.wait()


def _marked(lines: Iterable[str]) -> Iterator[str]:
    """The child's markers among whatever else reaches its stdout."""
    return (line[2:].strip() for line in lines if line.startswith("@ "))


def test_keeper_reports_loss_when_redis_hangs(private_redis: RedisServer) -> None:
    store = RedisStateStore(private_redis.url, namespace="leader-test", socket_timeout_s=1.0)
    lost = threading.Event()
    keeper = LeaseKeeper(LeaderLease(store, TTL, "a"), on_lost=lost.set)
    assert keeper.wait_for_leadership() == 1
    private_redis.pause()  # every call now times out rather than failing fast
    frozen_at = time.monotonic()
    assert lost.wait(TTL * 3)
    # Reported no later than the TTL after the last renewal, plus one timed-out call.
    assert time.monotonic() - frozen_at <= TTL + TTL / 4 + 0.3
    assert not keeper.is_leader
    keeper.step_down()  # the release times out; it must not raise
    store.close()


def test_in_process_store_always_leads() -> None:
    store = InMemoryStateStore()
    lease = lease_for(store)
    assert isinstance(lease, LocalLease)
    keeper = LeaseKeeper(lease)
    assert keeper.wait_for_leadership() == 1
    assert keeper.is_leader and lease.holder() == lease.replica_id
    keeper.step_down()
    assert keeper.wait_for_leadership() == 2
    keeper.step_down()


def test_lease_for_a_redis_store(store: RedisStateStore) -> None:
    lease = lease_for(store, ttl_s=1.5, replica_id="r1")
    assert isinstance(lease, LeaderLease)
    assert (lease.ttl_s, lease.replica_id, lease.key) == (1.5, "r1", f"{store.namespace}:leader")
    with pytest.raises(ValueError):
        LeaderLease(store, ttl_s=0)
