"""The StateStore on Redis: what lets a killed scheduler restart without losing a request.

Key layout, every key under `{namespace}:` so deployments can share one Redis:

    epoch                 string   fencing epoch (raised by begin_epoch)
    last_commit           hash     {epoch, commit_id} of the last applied commit
    meta                  hash     engine facts (step_id, next_seq_id, ...)
    groups                hash     request_id -> the group's last snapshot (JSON)
    deltas:{request_id}   string   the deltas written since, each a "\n" and a JSON line
    pending_step          string   the step sent (persistence.PendingStep), its result not applied
    queue                 list     submitted, not yet consumed request ids, oldest first
    request:{request_id}  string   the submitted record
    events:{request_id}   list     the request's output stream; event i is at index i - 1
    lanes                 set      names of the executor lanes below
    aborts                list     request ids any replica asked to abort, drained by the leader
    wake                  list     at most one token: work arrived (BLPOP by an idle leader)
    leader                string   the engine leader's replica id, with a TTL (leader.py)

and one pub/sub channel, `events`: each commit publishes the events it appended,
`{"index": [...], "events": [[request_id, event JSON], ...]}`, to the front doors
following them (scheduler_svc/state/redis_notify.py).

With several executors each engine lane commits through `lane(name)`, whose last_commit,
meta, groups, deltas and pending_step live under `lane:{name}:` instead; the epoch, the
queue, records and events stay shared.

Snapshots live in one hash rather than a key each, so `load()` finds every group with one
HGETALL instead of a SCAN over the keyspace. Deltas go to a string per group, where APPEND
costs the delta's length; appended to the hash value (HGET, concatenate, HSET in the script)
each would cost the whole value. A value written by an older version, snapshot and deltas in
one hash field, still reads. A snapshot must stay far below Redis' 512 MB value limit, which a
group always does.

Every key a script touches is passed in KEYS, as Redis asks of scripts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NoReturn

import orjson
import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from scheduler_svc.state.redis_notify import EventNotifier
from scheduler_svc.state.state_store import (
    StepCommit,
    StoredState,
    StoreUnavailableError,
    check_epoch,
)
from scheduler_svc.state.wakeups import OnEvents, wait_events

# KEYS[1..6]: epoch, last_commit, meta, groups, pending_step, queue; then for the i-th id of
# c.touched: KEYS[5 + 2i] its events list and KEYS[6 + 2i] its submitted record; then for the
# j-th id of c.grouped: KEYS[6 + 2 * #c.touched + j] its deltas; then for the k-th pair of
# c.taken_over, with b = 6 + 2 * #c.touched + #c.grouped: KEYS[b + 2k - 1] the groups hash of
# the lane it moves from and KEYS[b + 2k] its deltas there.
# ARGV[1]: the commit as JSON; ARGV[2]: milliseconds a finished request's keys live (0: forever);
# ARGV[3]: the events channel; ARGV[4]: c.events as JSON, published with their indices added
# by concatenation, which spares the script a cjson.encode of the events.
_COMMIT_LUA = """
local c = cjson.decode(ARGV[1])
local ttl_ms = tonumber(ARGV[2])
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
if c.epoch ~= epoch then return redis.error_reply('EPOCH_MISMATCH ' .. epoch) end
local last = redis.call('HMGET', KEYS[2], 'epoch', 'commit_id')
if tonumber(last[1] or '0') == c.epoch and c.commit_id <= tonumber(last[2] or '0') then
  return 0
end
for k, _ in pairs(c.append_groups) do
  if c.upsert_groups[k] == nil and redis.call('HEXISTS', KEYS[4], k) == 0 then
    return redis.error_reply('NO_GROUP ' .. k)
  end
end
redis.call('HSET', KEYS[2], 'epoch', c.epoch, 'commit_id', c.commit_id)
local slot = {}
for i, rid in ipairs(c.touched) do slot[rid] = 5 + 2 * i end
local deltas = {}
for j, rid in ipairs(c.grouped) do deltas[rid] = KEYS[6 + 2 * #c.touched + j] end
for k, v in pairs(c.meta) do redis.call('HSET', KEYS[3], k, v) end
for k, v in pairs(c.upsert_groups) do
  redis.call('HSET', KEYS[4], k, v)
  redis.call('DEL', deltas[k])
end
for k, v in pairs(c.append_groups) do redis.call('APPEND', deltas[k], '\\n' .. v) end
for _, rid in ipairs(c.delete_groups) do
  redis.call('HDEL', KEYS[4], rid)
  redis.call('DEL', deltas[rid])
end
local taken = 6 + 2 * #c.touched + #c.grouped
for k, rid in ipairs(c.taken_over) do
  if KEYS[taken + 2 * k - 1] ~= KEYS[4] then
    redis.call('HDEL', KEYS[taken + 2 * k - 1], rid)
    redis.call('DEL', KEYS[taken + 2 * k])
  end
end
if c.pending_step then
  redis.call('SET', KEYS[5], c.pending_step)
elseif c.clear_pending_step then
  redis.call('DEL', KEYS[5])
end
local indices = {}
for i, e in ipairs(c.events) do indices[i] = redis.call('RPUSH', KEYS[slot[e[1]]], e[2]) end
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
if #indices > 0 then
  redis.call('PUBLISH', ARGV[3], '{"index":[' .. table.concat(indices, ',') .. '],"events":'
    .. ARGV[4] .. '}')
end
return 1
"""

# KEYS: request record, queue, wake. ARGV: request_id, record.
_SUBMIT_LUA = """
if redis.call('SET', KEYS[1], ARGV[2], 'NX') then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('RPUSH', KEYS[3], '1')
  redis.call('LTRIM', KEYS[3], -1, -1)
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


# KEYS: epoch, aborts. ARGV: the caller's epoch.
_TAKE_ABORTS_LUA = """
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= epoch then return redis.error_reply('EPOCH_MISMATCH ' .. epoch) end
local ids = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[2])
return ids
"""


# KEYS: epoch. ARGV: the least epoch to take. One more than the stored one, or more.
_BEGIN_EPOCH_LUA = """
local epoch = tonumber(redis.call('GET', KEYS[1]) or '0') + 1
if epoch < tonumber(ARGV[1]) then epoch = tonumber(ARGV[1]) end
redis.call('SET', KEYS[1], epoch)
return epoch
"""


# What a store call raises when the store does not answer: worth waiting out, unlike a
# refusal.
OUTAGE_ERRORS = (StoreUnavailableError, redis.ConnectionError, redis.TimeoutError)


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
        finished_ttl_s: float | None = 3600.0,
    ) -> None:
        """Connect lazily to `url` (redis://host:port/db).

        Args:
            finished_ttl_s: how long a finished request's events and record outlive its group
                when no client calls `delete_events`; None keeps them until then.
        """
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.namespace = namespace
        self.url = url  # for the clients of leader.py and redis_notify.py
        self.lane_name = ""  # "" is the root: a single executor's state
        self._block_cap_s = socket_timeout_s / 2  # a BLPOP must end before the socket times out
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
        self._take_aborts = self._redis.register_script(_TAKE_ABORTS_LUA)
        self._begin_epoch = self._redis.register_script(_BEGIN_EPOCH_LUA)
        self._notifier = EventNotifier(url, self._key("events"))  # shared by lane views

    def _key(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def _lane_key(self, *parts: str) -> str:
        """Keys of this engine lane: last_commit, meta, groups, deltas, pending_step."""
        return self._lane_key_of(self.lane_name, *parts)

    def _lane_key_of(self, lane_name: str, *parts: str) -> str:
        return self._key("lane", lane_name, *parts) if lane_name else self._key(*parts)

    def lane(self, name: str) -> RedisStateStore:
        """A view sharing this store's connections; see the module docstring for its keys."""
        if not name:
            raise ValueError("a lane needs a name")
        view = copy.copy(self)
        view.lane_name = name
        self._redis.sadd(self._key("lanes"), name)
        return view

    def lane_names(self) -> list[str]:
        return sorted(self._redis.smembers(self._key("lanes")))

    def drop_lane(self, name: str) -> None:
        view = self.lane(name)
        request_ids = self._redis.hkeys(view._lane_key("groups"))
        pipe = self._redis.pipeline(transaction=True)
        for part in ("last_commit", "meta", "groups", "pending_step"):
            pipe.delete(view._lane_key(part))
        for rid in request_ids:
            pipe.delete(view._lane_key("deltas", rid))
        pipe.srem(self._key("lanes"), name)
        pipe.execute()

    def ping(self) -> bool:
        """True when Redis answers; False on a connection error or timeout."""
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        """Close the pooled connections and the event listener (both restart on next use)."""
        self._notifier.close()
        self._redis.close()

    def begin_epoch(self, at_least: int = 0) -> int:
        """Raise the epoch by one, or to ``at_least``; commits from older epochs are refused
        from now on."""
        return int(self._begin_epoch(keys=[self._key("epoch")], args=[at_least]))

    def current_epoch(self) -> int:
        return int(self._redis.get(self._key("epoch")) or 0)

    def load(self) -> StoredState:
        """Read everything between two commits: last_commit, which every commit writes, is
        watched, and a commit landing during the reads makes them start over."""
        last_commit = self._lane_key("last_commit")

        def read(pipe: redis.client.Pipeline) -> StoredState:
            snapshots = pipe.hgetall(self._lane_key("groups"))
            keys = [self._lane_key("deltas", rid) for rid in snapshots]
            deltas = pipe.mget(keys) if keys else []
            state = StoredState(
                epoch=int(pipe.get(self._key("epoch")) or 0),
                last_commit_id=int(pipe.hget(last_commit, "commit_id") or 0),
                meta=pipe.hgetall(self._lane_key("meta")),
                groups={
                    rid: text + (more or "")
                    for (rid, text), more in zip(snapshots.items(), deltas, strict=True)
                },
                pending_step=pipe.get(self._lane_key("pending_step")),
            )
            pipe.multi()
            pipe.hget(last_commit, "commit_id")  # EXEC fails, and read runs again, if it moved
            return state

        return self._redis.transaction(read, last_commit, value_from_callable=True)

    def commit(self, commit: StepCommit) -> bool:
        """Apply one step in one Lua script (see the module docstring for the keys it writes)."""
        touched = commit.touched_requests()
        payload: dict[str, object] = {
            "epoch": commit.epoch,
            "commit_id": commit.commit_id,
            "touched": touched,
            "meta": commit.meta,
            "upsert_groups": commit.upsert_groups,
            "append_groups": commit.append_groups,
            "delete_groups": commit.delete_groups,
            "clear_pending_step": commit.clear_pending_step,
            "events": commit.events,
            "consumed": commit.new_requests_consumed,
            "taken_over": list(commit.taken_over),
            "release": list(dict.fromkeys(commit.delete_groups + commit.new_requests_consumed)),
        }
        groups = [*commit.upsert_groups, *commit.append_groups, *commit.delete_groups]
        grouped = payload["grouped"] = list(dict.fromkeys(groups))
        if commit.pending_step is not None:  # absent, not null: cjson's null is truthy in Lua
            payload["pending_step"] = commit.pending_step
        keys = [self._key("epoch")]
        keys += [self._lane_key(k) for k in ("last_commit", "meta", "groups", "pending_step")]
        keys.append(self._key("queue"))
        # By prefix: a commit names three keys for each of hundreds of requests.
        events, request, deltas = (
            self._key("events", ""),
            self._key("request", ""),
            self._lane_key("deltas", ""),
        )
        for rid in touched:
            keys += (events + rid, request + rid)
        keys += [deltas + rid for rid in grouped]
        for rid, source in commit.taken_over.items():
            keys += [self._lane_key_of(source, "groups"), self._lane_key_of(source, "deltas", rid)]
        args = [orjson.dumps(payload), self._finished_ttl_ms]
        args += [self._notifier.channel, orjson.dumps(commit.events)]
        try:
            return bool(self._commit(keys=keys, args=args))
        except ResponseError as err:
            _raise_refusal(err, commit.epoch)
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise StoreUnavailableError(f"commit {commit.commit_id}: {err}") from err

    def read_events(self, request_id: str, after: int = 0) -> list[tuple[int, str]]:
        start = max(after, 0)
        events = self._redis.lrange(self._key("events", request_id), start, -1)
        return list(enumerate(events, start=start + 1))

    def delete_events(self, request_id: str) -> None:
        """DEL the output stream, and the record too when the group is gone and not queued."""
        keys = [self._key("events", request_id), self._key("request", request_id)]
        keys += [self._lane_key("groups"), self._key("queue")]
        self._delete_events(keys=keys, args=[request_id])

    def submit_request(self, request_id: str, record: str) -> bool:
        """SET NX the record and RPUSH its id to the queue in one script."""
        keys = [self._key("request", request_id), self._key("queue"), self._key("wake")]
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

    def request_abort(self, request_id: str) -> None:
        """RPUSH the id to `aborts` and raise the wake token, in one MULTI."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.rpush(self._key("aborts"), request_id)
        pipe.rpush(self._key("wake"), "1")
        pipe.ltrim(self._key("wake"), -1, -1)
        pipe.execute()

    def take_aborts(self, epoch: int) -> list[str]:
        """LRANGE and DEL `aborts` in one script, refused (StaleEpochError) to an old leader."""
        keys = [self._key("epoch"), self._key("aborts")]
        try:
            ids = self._take_aborts(keys=keys, args=[epoch])
        except ResponseError as err:
            _raise_refusal(err, epoch)
        return list(dict.fromkeys(ids))

    def wait_for_work(self, timeout_s: float) -> bool:
        """BLPOP the wake token; waits at most half the socket timeout, whatever `timeout_s`."""
        if timeout_s <= 0:  # BLPOP's 0 means forever
            return self._redis.lpop(self._key("wake")) is not None
        timeout = min(timeout_s, self._block_cap_s)
        return self._redis.blpop([self._key("wake")], timeout=timeout) is not None

    def watch_events(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        """Subscribe (once per store) to the events channel; see redis_notify.py."""
        return self._notifier.watch(request_id, on_events)

    def wait_events(self, request_id: str, after: int, timeout_s: float) -> list[tuple[int, str]]:
        return wait_events(self, request_id, after, timeout_s)


def _raise_refusal(err: ResponseError, epoch: int) -> NoReturn:
    """Turn a script's refusal into the StateStore's errors: EPOCH_MISMATCH into
    StaleEpochError or ValueError, NO_GROUP (an append without a snapshot) into ValueError."""
    if str(err).startswith("NO_GROUP"):
        raise ValueError(f"appending to a group the store does not hold: {err}") from err
    if not str(err).startswith("EPOCH_MISMATCH"):
        raise err
    check_epoch(epoch, int(str(err).split()[1]))
    raise AssertionError(f"epoch check disagrees with the script: {err}") from err
