"""A request's inbox on the leader: a streaming client is woken at every event, one that
reads the whole answer only at the end (or when the term or the engine ends)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.engine.async_engine import STEPPED_DOWN, _Inbox
from scheduler_svc.state.streams import RequestDelta


async def _woken(inbox: _Inbox) -> list | None:
    """What a take returns within a moment, or None when nothing woke it."""
    try:
        return await asyncio.wait_for(inbox.take(), timeout=0.05)
    except TimeoutError:
        return None


@pytest.mark.parametrize("each_event", [True, False])
def test_a_client_reading_the_whole_answer_wakes_at_its_end(each_event: bool) -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event)
        events = [RequestDelta("r", 4, event) for event in (1, 2)]
        inbox.put(events[0])
        assert await _woken(inbox) == ([events[0]] if each_event else None)
        inbox.put(events[1])
        last = RequestDelta("r", 4, 3, finished=True)
        inbox.put(last)
        taken = await _woken(inbox)
        assert taken == ([events[1], last] if each_event else [*events, last])
        assert await _woken(inbox) is None  # drained

    asyncio.run(scenario())


@pytest.mark.parametrize("item", [STEPPED_DOWN, RuntimeError("engine failed")])
def test_the_end_of_a_term_or_of_the_engine_wakes_every_client(item: object) -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event=False)
        inbox.put(RequestDelta("r", 4, 1))
        inbox.put(item)
        assert await _woken(inbox) == [RequestDelta("r", 4, 1), item]

    asyncio.run(scenario())
