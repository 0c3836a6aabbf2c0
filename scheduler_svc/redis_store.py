"""The StateStore on Redis: what lets a killed scheduler restart without losing a request.

Key layout, every key under `{namespace}:` so deployments can share one Redis:

    epoch                 string   fencing epoch (INCR by begin_epoch)
    last_commit           hash     {epoch, commit_id} of the last applied commit
    meta                  hash     engine facts (step_id, next_seq_id, ...)
    groups                hash     request_id -> group JSON
    pending_step          string   step JSON sent to the executor, result not yet applied
    queue                 list     submitted, not yet consumed request ids, oldest first
    request:{request_id}  string   the submitted record
    events:{request_id}   list     the request's output stream; event i is at index i - 1

Groups live in one hash rather than a key each: `load()` is one HGETALL instead of a SCAN
over the keyspace, and the commit script touches a fixed set of keys whatever the batch size.
A snapshot must stay far below Redis' 512 MB value limit, which a group always does.

Every key a script touches is passed in KEYS, as Redis asks of scripts.
"""

from __future__ import annotations

import json

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from scheduler_svc.state_store import StepCommit, StoredState, check_epoch

# KEYS[1..6]: epoch, last_commit, meta, groups, pending_step, queue; then for the i-th id of
# c.touched: KEYS[5 + 2i] its events list and KEYS[6 + 2i] its submitted record.
# ARGV[1]: the commit as JSON; ARGV[2]: milliseconds a finished request's keys live (0: forever).
_COMMIT_LUA = """
local c = cjson.decode(ARGV[1])
local ttl_ms = tonumber(ARGV[2])
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
if c.epoch ~= epoch then return redis.error_reply('EPOCH_MISMATCH ' .. epoch) end
local last = redis.call('HMGET', KEYS[2], 'epoch', 'commit_id')
if tonumber(last[1] or '0') == c.epoch and c.commit_id <= tonumber(last[2] or '0') then
  return 0
end
redis.call('HSET', KEYS[2], 'epoch', c.epoch, 'commit_id', c.commit_id)
local slot = {}
for i, rid in ipairs(c.touched) do slot[rid] = 5 + 2 * i end
for k, v in pairs(c.meta) do redis.call('HSET', KEYS[3], k, v) end
for k, v in pairs(c.upsert_groups) do redis.call('HSET', KEYS[4], k, v) end
for _, rid in ipairs(c.delete_groups) do redis.call('HDEL', KEYS[4], rid) end
if c.pending_step then
  redis.call('SET', KEYS[5], c.pending_step)
elseif c.clear_pending_step then
  redis.call('DEL', KEYS[5])
end
for _, e in ipairs(c.events) do redis.call('RPUSH', KEYS[slot[e[1]]], e[2]) end
for _, rid in ipairs(c.consumed) do redis.call('LREM', KEYS[6], 0, rid) end
for _, rid in ipairs(c.release) do
  local events_key, request_key = KEYS[slot[rid]], KEYS[slot[rid] + 1]
  if redis.call('HEXISTS', KEYS[4], rid) == 0 and redis.call('EXISTS', events_key) == 0
      and not redis.call('LPOS', KEYS[6], rid) then
    redis.call('DEL', request_key)
  end
end
if ttl_ms > 0 then
  for _, rid in ipairs(c.delete_groups) do
    redis.call('PEXPIRE', KEYS[slot[rid]], ttl_ms)
    redis.call('PEXPIRE', KEYS[slot[rid] + 1], ttl_ms)
  end
end
return 1
"""

# KEYS: request record, queue. ARGV: request_id, record.
_SUBMIT_LUA = """
if redis.call('SET', KEYS[1], ARGV[2], 'NX') then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# KEYS: events list, request record, groups, queue. ARGV: request_id.
_DELETE_EVENTS_LUA = """
redis.call('DEL', KEYS[1])
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 and not redis.call('LPOS', KEYS[4], ARGV[1]) then
  redis.call('DEL', KEYS[2])
end
return 1
"""


class RedisStateStore:
    """The StateStore shared by scheduler replicas and restarts; every mutation is one script.

    Commands are retried on connection errors: a retried commit is ignored by its commit id,
    but a retried `submit_request` whose first try landed answers False (already exists).
    """

    def __init__(
        self,
        url: str,
        namespace: str = "pagedserve",
        *,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        finished_ttl_s: int | None = 3600,
    ) -> None:
        """Connect lazily to `url` (redis://host:port/db).

        Args:
            finished_ttl_s: how long a finished request's events and record outlive its group
                when no client calls `delete_events`; None keeps them until then.
        """
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.namespace = namespace
        self._finished_ttl_ms = int(finished_ttl_s * 1000) if finished_ttl_s else 0
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        )
        self._commit = self._redis.register_script(_COMMIT_LUA)
        self._submit = self._redis.register_script(_SUBMIT_LUA)
        self._delete_events = self._redis.register_script(_DELETE_EVENTS_LUA)

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def ping(self) -> bool:
        """True when Redis answers; False on a connection error or timeout."""
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        """Close the pooled connections (the store reconnects on next use)."""
        self._redis.close()

    def begin_epoch(self) -> int:
        """INCR the epoch; commits from older epochs are refused from now on."""
        return int(self._redis.incr(self._key("epoch")))

    def current_epoch(self) -> int:
        return int(self._redis.get(self._key("epoch")) or 0)

    def load(self) -> StoredState:
        """Read everything in one MULTI, so the snapshot falls between two commits."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.get(self._key("epoch"))
        pipe.hget(self._key("last_commit"), "commit_id")
        pipe.hgetall(self._key("meta"))
        pipe.hgetall(self._key("groups"))
        pipe.get(self._key("pending_step"))
        epoch, last_commit_id, meta, groups, pending_step = pipe.execute()
        return StoredState(
            epoch=int(epoch or 0),
            last_commit_id=int(last_commit_id or 0),
            meta=meta,
            groups=groups,
            pending_step=pending_step,
        )

    def commit(self, commit: StepCommit) -> bool:
        """Apply one step in one Lua script (see the module docstring for the keys it writes)."""
        touched = commit.touched_requests()
        payload: dict[str, object] = {
            "epoch": commit.epoch,
            "commit_id": commit.commit_id,
            "touched": touched,
            "meta": commit.meta,
            "upsert_groups": commit.upsert_groups,
            "delete_groups": commit.delete_groups,
            "clear_pending_step": commit.clear_pending_step,
            "events": commit.events,
            "consumed": commit.new_requests_consumed,
            "release": list(dict.fromkeys(commit.delete_groups + commit.new_requests_consumed)),
        }
        if commit.pending_step is not None:  # absent, not null: cjson's null is truthy in Lua
            payload["pending_step"] = commit.pending_step
        keys = [self._key(k) for k in ("epoch", "last_commit", "meta", "groups")]
        keys += [self._key("pending_step"), self._key("queue")]
        for rid in touched:
            keys += [self._key("events", rid), self._key("request", rid)]
        # ensure_ascii=False hands cjson raw UTF-8 rather than \u escapes to re-encode.
        args = [json.dumps(payload, ensure_ascii=False), self._finished_ttl_ms]
        try:
            return bool(self._commit(keys=keys, args=args))
        except ResponseError as err:
            if not str(err).startswith("EPOCH_MISMATCH"):
                raise
            check_epoch(commit.epoch, int(str(err).split()[1]))
            raise AssertionError(f"epoch check disagrees with the script: {err}") from err

    def read_events(self, request_id: str, after: int = 0) -> list[tuple[int, str]]:
        start = max(after, 0)
        events = self._redis.lrange(self._key("events", request_id), start, -1)
        return list(enumerate(events, start=start + 1))

    def delete_events(self, request_id: str) -> None:
        """DEL the output stream, and the record too when the group is gone and not queued."""
        keys = [self._key("events", request_id), self._key("request", request_id)]
        keys += [self._key("groups"), self._key("queue")]
        self._delete_events(keys=keys, args=[request_id])

    def submit_request(self, request_id: str, record: str) -> bool:
        """SET NX the record and RPUSH its id to the queue in one script."""
        keys = [self._key("request", request_id), self._key("queue")]
        return bool(self._submit(keys=keys, args=[request_id, record]))

    def pending_requests(self) -> list[tuple[str, str]]:
        ids = self._redis.lrange(self._key("queue"), 0, -1)
        if not ids:
            return []
        records = self._redis.mget([self._key("request", rid) for rid in ids])
        # A record can vanish between the two reads only if its request already finished.
        return [(rid, rec) for rid, rec in zip(ids, records, strict=True) if rec is not None]

    def get_request(self, request_id: str) -> str | None:
        return self._redis.get(self._key("request", request_id))
