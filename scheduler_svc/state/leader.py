"""Which scheduler replica runs the engine loop: a Redis lease plus a fencing epoch.

The lease (`{namespace}:leader`, the holder's replica id, expiring after the TTL) only
decides who should lead; safety comes from the epoch each new holder takes with
`begin_epoch()`: commits, abort takes and Execute calls carry it, and the store and the
executors refuse an older one. So a leader that was paused past its TTL (SIGSTOP, a long GC,
a partition) and wakes up finds every write refused while its keeper reports the loss.

The in-process store needs no election: `lease_for` gives it a `LocalLease`, which always
wins, so the engine runs one code path embedded or replicated.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import StateStore

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = 3.0

# KEYS: the lease. ARGV: replica id, ttl ms. Ours already (a retry whose reply was lost) counts.
_ACQUIRE_LUA = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: the lease. ARGV: replica id, ttl ms.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: the lease. ARGV: replica id.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def new_replica_id() -> str:
    """host-pid-random: unique per process, readable in logs and /health."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Lease(Protocol):
    """A claim to lead. Calls may raise redis.RedisError; LeaseKeeper retries them."""

    replica_id: str
    ttl_s: float

    def acquire(self) -> int | None:
        """Take the lease if free (or already ours) and return a new fencing epoch; else None."""
        ...

    def renew(self) -> bool:
        """Extend the lease by the TTL; False when it is no longer ours."""
        ...

    def release(self) -> bool:
        """Give the lease up if it is still ours; True when it was."""
        ...

    def holder(self) -> str | None:
        """The replica id of the current leader, None when nobody leads."""
        ...


class LeaderLease:
    """The lease on Redis, on its own client: short timeouts and no retries, so that a call
    fails within a fraction of the TTL instead of outliving the lease it extends."""

    def __init__(
        self, store: RedisStateStore, ttl_s: float = DEFAULT_TTL_S, replica_id: str | None = None
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.store = store
        self.ttl_s = ttl_s
        self.replica_id = replica_id or new_replica_id()
        self.key = f"{store.namespace}:leader"
        self._ttl_ms = max(int(ttl_s * 1000), 1)
        self._redis = redis.Redis.from_url(
            store.url,
            decode_responses=True,
            socket_timeout=ttl_s / 4,
            socket_connect_timeout=ttl_s / 4,
            retry=Retry(NoBackoff(), retries=0),
        )
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)

    def acquire(self) -> int | None:
        """SET the lease with a TTL if nobody holds it, then INCR the epoch (begin_epoch)."""
        if not self._acquire(keys=[self.key], args=[self.replica_id, self._ttl_ms]):
            return None
        return self.store.begin_epoch()

    def renew(self) -> bool:
        """PEXPIRE the lease only while it holds our id."""
        return bool(self._renew(keys=[self.key], args=[self.replica_id, self._ttl_ms]))

    def release(self) -> bool:
        """DEL the lease only while it holds our id."""
        return bool(self._release(keys=[self.key], args=[self.replica_id]))

    def holder(self) -> str | None:
        return self._redis.get(self.key)

    def close(self) -> None:
        self._redis.close()


class LocalLease:
    """Always the leader: for the in-process store, where only this process can commit."""

    def __init__(
        self, store: StateStore, ttl_s: float = DEFAULT_TTL_S, replica_id: str | None = None
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.replica_id = replica_id or new_replica_id()

    def acquire(self) -> int | None:
        return self.store.begin_epoch()

    def renew(self) -> bool:
        return True

    def release(self) -> bool:
        return True

    def holder(self) -> str | None:
        return self.replica_id


def lease_for(
    store: StateStore, ttl_s: float = DEFAULT_TTL_S, replica_id: str | None = None
) -> Lease:
    """A Redis lease for a Redis store, an always-won one for any other store."""
    if isinstance(store, RedisStateStore):
        return LeaderLease(store, ttl_s, replica_id)
    return LocalLease(store, ttl_s, replica_id)


class LeaseKeeper:
    """Holds a lease for one term at a time: waits for it as a standby, then renews it every
    ttl/3 in a daemon thread and calls `on_lost` once if it is lost.

    Lost means: a renewal found another holder or no lease, or no renewal succeeded for a
    whole TTL (Redis unreachable, or this process was paused). The lease is counted as held
    for one TTL from the moment the last successful renewal was *sent*, which is never later
    than Redis' own expiry, so `is_leader` turns False no later than a standby can take over.
    """

    def __init__(self, lease: Lease, on_lost: Callable[[], None] | None = None) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.epoch: int | None = None
        self._valid_until = 0.0  # monotonic; the lease is surely ours before it
        self._lost = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this replica may still act as leader, by its own clock (checks no Redis)."""
        return not self._lost and time.monotonic() < self._valid_until

    def wait_for_leadership(
        self, stop: threading.Event | None = None, poll_s: float | None = None
    ) -> int | None:
        """Try to acquire every `poll_s` (ttl/4) until it works: returns the term's epoch and
        starts renewing. Returns None once `stop` is set."""
        if not self._lost:
            raise RuntimeError("already leading: step_down() first")
        stop = stop or threading.Event()
        poll_s = self.lease.ttl_s / 4 if poll_s is None else poll_s
        while not stop.is_set():
            sent = time.monotonic()
            try:
                epoch = self.lease.acquire()
            except redis.RedisError as err:
                log.warning("lease acquire failed", error=str(err))
                epoch = None
            if epoch is not None:
                self._start_term(epoch, sent)
                return epoch
            stop.wait(poll_s)
        return None

    def step_down(self) -> None:
        """Stop renewing and release the lease if it is still ours (no `on_lost` call)."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():  # from on_lost
            thread.join()
        was_leader, self._lost = not self._lost, True
        if was_leader:
            try:
                self.lease.release()
            except redis.RedisError as err:  # it expires by itself within the TTL
                log.warning("lease release failed", error=str(err))

    def _start_term(self, epoch: int, sent: float) -> None:
        self.epoch = epoch
        self._valid_until = sent + self.lease.ttl_s
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keep, args=(self._stop,), name="lease-keeper", daemon=True
        )
        self._thread.start()
        log.info("leading", replica=self.lease.replica_id, epoch=epoch)

    def _keep(self, stop: threading.Event) -> None:
        """Keeper thread: renew every ttl/3 (ttl/10 after an error) until stopped or lost."""
        ttl = self.lease.ttl_s
        next_renewal = time.monotonic() + ttl / 3
        while not stop.wait(max(min(next_renewal, self._valid_until) - time.monotonic(), 0.0)):
            sent = time.monotonic()
            if sent >= self._valid_until:
                self._report_lost("no renewal succeeded for a whole ttl")
                return
            try:
                renewed = self.lease.renew()
            except redis.RedisError as err:
                log.warning("lease renewal failed", error=str(err))
                next_renewal = sent + ttl / 10
                continue
            if not renewed:
                self._report_lost("the lease expired or another replica holds it")
                return
            self._valid_until = sent + ttl
            next_renewal = sent + ttl / 3

    def _report_lost(self, why: str) -> None:
        self._lost = True
        log.warning("leadership lost", replica=self.lease.replica_id, epoch=self.epoch, why=why)
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("on_lost callback failed")
