"""A front door's view of requests when the engine may run in another replica: submit to
the store, then follow the request's event list there, so any replica can serve any client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.persistence import params_to_dict
from scheduler_svc.state_store import StateStore
from scheduler_svc.streams import RequestDelta, RequestInFlightError
from scheduler_svc.wakeups import Event

log = structlog.get_logger(__name__)


class RequestVanishedError(LookupError):
    """The request is not in the store (expired, deleted, or never submitted): no event of
    it will ever come, so following it would wait forever."""


def request_record(prompt_token_ids: list[int], params: SamplingParams, arrival: float) -> str:
    """The submitted record the leader reads back from `pending_requests()`."""
    record = {"prompt": prompt_token_ids, "params": params_to_dict(params), "arrival": arrival}
    return json.dumps(record)


class StoreStream:
    """`generate` with AsyncEngine.generate's shape, fed by the store instead of the engine.

    Events come pushed by the store's watch (pub/sub on Redis), so following a stream costs
    no store call per token. A follower that got nothing for `poll_s` reads the list anyway,
    in case a push was lost, and that is also when it notices a request that vanished.
    """

    def __init__(self, store: StateStore, poll_s: float = 1.0) -> None:
        self.store = store
        self.poll_s = poll_s
        self._streaming: set[str] = set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        after_event: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (or re-attach to it) and yield its events after ``after_event``.

        With ``after_event > 0`` the client is resuming: the request must exist already
        (RequestVanishedError otherwise) and is never submitted again. Closing the iterator
        before the finished event asks the leader to abort the request.
        """
        if request_id in self._streaming:
            raise RequestInFlightError(f"request id {request_id!r} is already being streamed")
        self._streaming.add(request_id)
        finished = False
        try:
            if after_event == 0:
                record = request_record(prompt_token_ids, params, time.time())
                await asyncio.to_thread(self.store.submit_request, request_id, record)
            async for delta in self._follow(request_id, after_event):
                finished = delta.finished
                yield delta
        finally:
            self._streaming.discard(request_id)
            if not finished:
                self._abort_quietly(request_id)

    def abort(self, request_id: str) -> bool:
        """Ask the leader to abort; returns whether a client was following it here."""
        self.store.request_abort(request_id)
        return request_id in self._streaming

    async def _follow(self, request_id: str, after: int) -> AsyncIterator[RequestDelta]:
        """Yield events after `after` until the finished one: pushed ones as they come, the
        list read at the start, after a gap, a missed push or `poll_s` without a push."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[list[Event] | None] = asyncio.Queue()

        def on_events(events: list[Event] | None) -> None:  # called from the store's thread
            loop.call_soon_threadsafe(inbox.put_nowait, events)

        unwatch = await asyncio.to_thread(self.store.watch_events, request_id, on_events)
        try:
            events = await asyncio.to_thread(self.store.read_events, request_id, after)
            timed_out = after > 0  # a resume must find the request before waiting for it
            while True:
                for index, text in events:
                    if index <= after:  # pushed before the read that already had it
                        continue
                    delta = RequestDelta.from_json(text)
                    after = index
                    yield delta
                    if delta.finished:
                        return
                if timed_out and not events and not await self._exists(request_id, after):
                    raise RequestVanishedError(f"request {request_id!r} is not in the store")
                events, timed_out = await self._next_events(request_id, after, inbox)
        finally:
            unwatch()

    async def _next_events(
        self, request_id: str, after: int, inbox: asyncio.Queue[list[Event] | None]
    ) -> tuple[list[Event], bool]:
        """The next events after `after` and whether `poll_s` passed without a push."""
        try:
            pushed = await asyncio.wait_for(inbox.get(), self.poll_s)
        except TimeoutError:
            return await asyncio.to_thread(self.store.read_events, request_id, after), True
        fresh = [] if pushed is None else [(i, t) for i, t in pushed if i > after]
        if pushed is None or (fresh and fresh[0][0] != after + 1):  # missed some: read them
            return await asyncio.to_thread(self.store.read_events, request_id, after), False
        return fresh, False

    async def _exists(self, request_id: str, after: int) -> bool:
        """Whether the request can still produce (or has) events after `after`."""
        if await asyncio.to_thread(self.store.get_request, request_id) is not None:
            return True
        # Record and events expire together, though not at the same instant: events still
        # there past `after` count.
        return bool(await asyncio.to_thread(self.store.read_events, request_id, after))

    def _abort_quietly(self, request_id: str) -> None:
        """Abort on early close; a store error here must not hide the consumer's own exit."""
        try:
            self.store.request_abort(request_id)
        except Exception as err:  # the request then runs to its end, unread
            log.warning("abort request failed", request_id=request_id, error=str(err))
