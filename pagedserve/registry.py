"""Executors announce themselves in Redis; the engine leader finds them there.

Keys under `{namespace}:` (shared with the scheduler's state store):

    executors                 hash    executor id -> ExecutorRecord JSON
    executor:{id}:alive       string  heartbeat, expires after the TTL unless renewed
    executor:{id}:released    string  set by the leader: a draining executor may exit

An executor's id is the address the scheduler dials (host:port), so each one is reached
by itself, never through a load balancer: its KV pool is its own. A record whose heartbeat
expired is an executor that vanished; the leader recomputes its requests elsewhere and
deletes the record.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import redis

from pagedserve.redis_url import check_redis_url


@dataclass(frozen=True, slots=True)
class ExecutorRecord:
    """What an executor says about itself."""

    address: str  # host:port the scheduler dials; also the id
    model: str
    block_size: int
    instance_id: str  # changes when the process restarts (its pools are new)
    draining: bool = False
    drain_deadline: float = 0.0  # wall-clock seconds; after it the executor exits anyway

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ExecutorRecord:
        return cls(**json.loads(text))


class ExecutorRegistry:
    """Registration, heartbeat and drain hand-shake of executors, on one Redis."""

    def __init__(self, url: str, namespace: str = "pagedserve", ttl_s: float = 3.0) -> None:
        check_redis_url(url)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def announce(self, record: ExecutorRecord) -> None:
        """Write the record and renew the heartbeat (call every ttl/3)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key("executors"), record.address, record.to_json())
        pipe.set(self._key("executor", record.address, "alive"), "1", px=int(self.ttl_s * 1000))
        pipe.execute()

    def withdraw(self, address: str) -> None:
        """Remove an executor for good (it exited, or it vanished and was replaced)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.hdel(self._key("executors"), address)
        pipe.delete(self._key("executor", address, "alive"))
        pipe.delete(self._key("executor", address, "released"))
        pipe.execute()

    def executors(self) -> tuple[dict[str, ExecutorRecord], set[str]]:
        """Registered executors, and the ids among them whose heartbeat expired."""
        records = {
            address: ExecutorRecord.from_json(text)
            for address, text in self._redis.hgetall(self._key("executors")).items()
        }
        if not records:
            return {}, set()
        alive = self._redis.mget([self._key("executor", a, "alive") for a in records])
        gone = {a for a, beat in zip(records, alive, strict=True) if beat is None}
        return records, gone

    def release(self, address: str) -> None:
        """Tell a draining executor that nothing of ours runs on it any more."""
        self._redis.set(self._key("executor", address, "released"), "1", ex=3600)

    def is_released(self, address: str) -> bool:
        return bool(self._redis.exists(self._key("executor", address, "released")))

    def clear_release(self, address: str) -> None:
        self._redis.delete(self._key("executor", address, "released"))

    def close(self) -> None:
        self._redis.close()


def drain_deadline(budget_s: float) -> float:
    """The wall-clock time a drain started now must end by."""
    return time.time() + budget_s
