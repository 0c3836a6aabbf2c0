"""Hands each commit's events to the front doors following them, on every replica.

The commit script publishes the events it appended, as one JSON object per commit
(`{"index": [...], "events": [[request_id, event JSON], ...]}`, index i for event i), on
the channel `{namespace}:events`. Each
store listens on one pub/sub connection in a daemon thread and passes the events to the
callbacks registered for their requests: a front door streaming tokens reads nothing from
Redis, and one message per step reaches each replica whatever the number of streams.
Pub/sub drops what is published while a listener is disconnected (or was cut off by Redis'
pub/sub output buffer limit for falling behind): after a reconnect every watcher is told
it may have missed events, and reads the list.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import orjson
import redis
import structlog

from scheduler_svc.state.wakeups import OnEvents, Watchers

log = structlog.get_logger(__name__)


class EventNotifier:
    """One pub/sub listener per store (and its lane views), started by the first `watch`."""

    def __init__(self, url: str, channel: str, subscribe_timeout_s: float = 5.0) -> None:
        self.channel = channel
        self._url = url
        self._subscribe_timeout_s = subscribe_timeout_s
        self._lock = threading.Lock()
        self._watchers = Watchers()
        self._subscribed = threading.Event()  # set by the listener on the first confirmation
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        """Pass `request_id`'s new events to `on_events`, from the listener thread.

        Returns once the subscription is live, so no event committed after this call is
        missed silently; `on_events` must be quick and must not block. Returns the unwatch
        function.
        """
        self._start()
        if not self._subscribed.wait(self._subscribe_timeout_s):
            raise redis.ConnectionError(f"could not subscribe to {self.channel!r}")
        return self._watchers.add(request_id, on_events)

    def close(self) -> None:
        """Stop the listener thread (a later `watch` starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._closed.set()
            thread.join()
            self._closed.clear()
            self._subscribed.clear()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._listen, name=f"events:{self.channel}", daemon=True
                )
                self._thread.start()

    def _listen(self) -> None:
        """Listener thread: subscribe, then dispatch until closed, reconnecting on errors."""
        client = redis.Redis.from_url(
            self._url,
            decode_responses=True,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            client_name=f"listener:{self.channel}",  # findable in CLIENT LIST
        )
        pubsub = client.pubsub()
        backoff = 0.05
        try:
            while not self._closed.is_set():
                try:
                    if not pubsub.subscribed:
                        pubsub.subscribe(self.channel)
                    message = pubsub.get_message(timeout=0.2)
                    backoff = 0.05
                except redis.RedisError as err:
                    log.warning("event listener lost redis", channel=self.channel, error=str(err))
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                if message is not None:
                    self._dispatch(message)
        finally:
            pubsub.close()
            client.close()

    def _dispatch(self, message: dict) -> None:
        if message["type"] == "subscribe":  # the first subscription, or back after a reconnect
            self._subscribed.set()
            self._watchers.push_missed()
        elif message["type"] == "message":
            data = orjson.loads(message["data"])
            pushed = zip(data["events"], data["index"], strict=True)
            self._watchers.push([(rid, index, text) for (rid, text), index in pushed])
