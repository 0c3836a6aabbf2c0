"""A front door's view of requests when the engine may run in another replica: submit to
the store, then follow the request's event list there, so any replica can serve any client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.state.persistence import params_to_dict
from scheduler_svc.state.redis_store import OUTAGE_ERRORS
from scheduler_svc.state.state_store import StateStore, StoreUnavailableError
from scheduler_svc.state.streams import RequestDelta, RequestInFlightError
from scheduler_svc.state.wakeups import Event

log = structlog.get_logger(__name__)
T = TypeVar("T")


class RequestVanishedError(LookupError):
    """The request is not in the store (expired, deleted, or never submitted): no event of
    it will ever come, so following it would wait forever."""


class RequestIdConflictError(ValueError):
    """The request id names a stored request with another prompt or other sampling params:
    an idempotency key is bound to the body it was first sent with."""


class EventOutOfRangeError(ValueError):
    """A resume asks for events after the request's last one, which it never had."""


def request_record(
    prompt_token_ids: list[int], params: SamplingParams, arrival: float, owner: str = ""
) -> str:
    """The submitted record the leader reads back from `pending_requests()`; ``owner`` is
    who may see the request (a hash of the API key it came with, "" without keys)."""
    record = {
        "prompt": prompt_token_ids,
        "params": params_to_dict(params),
        "arrival": arrival,
        "owner": owner,
    }
    return json.dumps(record)


def submit(
    store: StateStore,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    arrival: float,
    owner: str = "",
) -> bool:
    """Store and queue the request; False when its id is known already.

    Raises:
        RequestIdConflictError: the known id was sent with another prompt or params.
    """
    record = request_record(prompt_token_ids, params, arrival, owner)
    if store.submit_request(request_id, record):
        return True
    check_same_request(store.get_request(request_id), prompt_token_ids, params)
    return False


def check_same_request(
    stored: str | None, prompt_token_ids: list[int], params: SamplingParams
) -> None:
    """Raise RequestIdConflictError unless ``stored`` (a request record, or None when
    there is none to compare with) holds this prompt and these params."""
    if stored is None:
        return
    record, sent = json.loads(stored), json.loads(request_record(prompt_token_ids, params, 0))
    for field, what in (("prompt", "prompt"), ("params", "sampling parameters")):
        if record.get(field) != sent[field]:
            raise RequestIdConflictError(
                f"the request id names a request with a different {what}: send the same "
                "body again to get its result, or use a new request id"
            )


def request_owner(store: StateStore, request_id: str) -> str | None:
    """Who submitted the request ("" without API keys); None when the store has no record."""
    stored = store.get_request(request_id)
    return None if stored is None else json.loads(stored).get("owner", "")


class StoreStream:
    """`generate` with AsyncEngine.generate's shape, fed by the store instead of the engine.

    Events come pushed by the store's watch (pub/sub on Redis), so following a stream costs
    no store call per token. A follower that got nothing for `poll_s` reads the list anyway,
    in case a push was lost, and that is also when it notices a request that vanished.
    """

    def __init__(self, store: StateStore, poll_s: float = 1.0, budget_s: float = 30.0) -> None:
        """Args:
        budget_s: how long a follower waits out a store that does not answer before its
            stream ends with StoreUnavailableError (the request itself goes on).
        """
        self.store = store
        self.poll_s = poll_s
        self.budget_s = budget_s
        self._streaming: set[str] = set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        after_event: int | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (or re-attach to it) and yield its events.

        With ``after_event`` the client is resuming after that event: the request must
        exist already (RequestVanishedError otherwise) and is never submitted again. A known
        id with another prompt or params raises RequestIdConflictError; a resume past the
        request's last event raises EventOutOfRangeError. Closing the iterator before the
        finished event asks the leader to abort the request.
        """
        if request_id in self._streaming:
            raise RequestInFlightError(f"request id {request_id!r} is already being streamed")
        self._streaming.add(request_id)
        finished = left = False
        try:
            if after_event is None:
                args = (self.store, request_id, prompt_token_ids, params, time.time())
                await asyncio.to_thread(submit, *args)
            else:
                stored = await self._patient(self.store.get_request, request_id)
                check_same_request(stored, prompt_token_ids, params)
            resuming = after_event is not None
            async for delta in self._follow(request_id, after_event or 0, resuming):
                finished = delta.finished
                yield delta
        except (GeneratorExit, asyncio.CancelledError):
            left = True  # the client went away: its request stops
            raise
        finally:
            self._streaming.discard(request_id)
            if left and not finished:
                self._abort_quietly(request_id)

    def abort(self, request_id: str) -> bool:
        """Ask the leader to abort; returns whether a client was following it here."""
        self.store.request_abort(request_id)
        return request_id in self._streaming

    async def _follow(
        self, request_id: str, after: int, resuming: bool
    ) -> AsyncIterator[RequestDelta]:
        """Yield events after `after` until the finished one: pushed ones as they come, the
        list read at the start, after a gap, a missed push or `poll_s` without a push. A
        resume must find the request in the store before it waits for an event.

        Every event is read, the ones up to `after` too: a request that ended before the
        event a resume names ends the resume (EventOutOfRangeError) instead of hanging it.
        """
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[list[Event] | None] = asyncio.Queue()

        def on_events(events: list[Event] | None) -> None:  # called from the store's thread
            loop.call_soon_threadsafe(inbox.put_nowait, events)

        unwatch = await self._patient(self.store.watch_events, request_id, on_events)
        try:
            seen = 0  # events read so far
            events = await self._patient(self.store.read_events, request_id)
            timed_out = resuming
            while True:
                for index, text in events:
                    if index <= seen:  # pushed before the read that already had it
                        continue
                    seen = index
                    delta = RequestDelta.from_json(text)
                    if index > after:
                        yield delta
                    elif delta.finished:
                        raise EventOutOfRangeError(
                            f"request {request_id!r} ended with event {index}; "
                            f"it has no event {after + 1}"
                        )
                    if delta.finished:
                        return
                if timed_out and not events and not await self._exists(request_id, seen):
                    raise RequestVanishedError(f"request {request_id!r} is not in the store")
                events, timed_out = await self._next_events(request_id, seen, inbox)
        finally:
            unwatch()

    async def _next_events(
        self, request_id: str, after: int, inbox: asyncio.Queue[list[Event] | None]
    ) -> tuple[list[Event], bool]:
        """The next events after `after` and whether `poll_s` passed without a push."""
        try:
            pushed = await asyncio.wait_for(inbox.get(), self.poll_s)
        except TimeoutError:
            return await self._patient(self.store.read_events, request_id, after), True
        fresh = [] if pushed is None else [(i, t) for i, t in pushed if i > after]
        if pushed is None or (fresh and fresh[0][0] != after + 1):  # missed some: read them
            return await self._patient(self.store.read_events, request_id, after), False
        return fresh, False

    async def _exists(self, request_id: str, after: int) -> bool:
        """Whether the request can still produce (or has) events after `after`."""
        if await self._patient(self.store.get_request, request_id) is not None:
            return True
        # Record and events expire together, though not at the same instant: events still
        # there past `after` count.
        return bool(await self._patient(self.store.read_events, request_id, after))

    async def _patient(self, call: Callable[..., T], *args: object) -> T:
        """``call(*args)`` in a thread, retried while the store does not answer, for up to
        ``budget_s``; then StoreUnavailableError, which the client can act on (resume with
        Last-Event-ID), never a silent end."""
        deadline = time.monotonic() + self.budget_s
        delay = 0.1
        while True:
            try:  # a call to a paused store can block for its client's retries: bound it
                remaining = max(deadline - time.monotonic(), delay)
                return await asyncio.wait_for(asyncio.to_thread(call, *args), remaining)
            except (*OUTAGE_ERRORS, TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(
                        f"the state store has not answered for {self.budget_s:.0f} s ({e}); "
                        "the request goes on: resume it with Last-Event-ID"
                    ) from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _abort_quietly(self, request_id: str) -> None:
        """Abort on early close; a store error here must not hide the consumer's own exit."""
        try:
            self.store.request_abort(request_id)
        except Exception as err:  # the request then runs to its end, unread
            log.warning("abort request failed", request_id=request_id, error=str(err))
