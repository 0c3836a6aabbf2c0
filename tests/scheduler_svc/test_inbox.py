"""A request's inbox on the leader: a streaming client is woken at every event, one that
reads the whole answer only at the end (or when the term or the engine ends), its events
folded into one meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.engine.async_engine import STEPPED_DOWN, _Inbox
from scheduler_svc.state.streams import RequestDelta, SeqDelta


async def _woken(inbox: _Inbox) -> list | None:
    """What a take returns within a moment, or None when nothing woke it."""
    try:
        return await asyncio.wait_for(inbox.take(), timeout=0.05)
    except TimeoutError:
        return None


def _event(event: int, text: str, finished: bool = False, index: int = 0) -> RequestDelta:
    """An event adding ``text`` as one token per character to output ``index``."""
    tokens = [ord(c) for c in text]
    reason = "stop" if finished else None
    out = SeqDelta(index, text, tokens, [-0.5] * len(tokens), [{t: -0.5} for t in tokens], reason)
    return RequestDelta("r", 4, event, [out], finished=finished)


@pytest.mark.parametrize("each_event", [True, False])
def test_a_client_reading_the_whole_answer_wakes_at_its_end(each_event: bool) -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event)
        events = [_event(1, "Hel"), _event(2, "lo"), _event(3, "!", finished=True)]
        inbox.put(events[0])
        assert await _woken(inbox) == ([events[0]] if each_event else None)
        inbox.put(events[1])
        inbox.put(events[2])
        taken = await _woken(inbox)
        if each_event:
            assert taken == events[1:]
        else:  # one event holding the three
            (whole,) = taken
            assert (whole.event, whole.finished) == (3, True)
            (out,) = whole.outputs
            assert out.text == "Hello!"
            assert out.token_ids == [ord(c) for c in "Hello!"]
            assert out.logprobs == [-0.5] * 6
            assert out.top_logprobs == [{ord(c): -0.5} for c in "Hello!"]
            assert out.finish_reason == "stop"
        assert await _woken(inbox) is None  # drained

    asyncio.run(scenario())


def test_folding_leaves_the_published_events_as_they_were() -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event=False)
        events = [_event(1, "a"), _event(2, "b", finished=True)]
        published = [RequestDelta.from_json(e.to_json()) for e in events]
        for event in events:
            inbox.put(event)
        await _woken(inbox)
        assert events == published

    asyncio.run(scenario())


def test_an_event_sent_again_is_folded_once_and_a_gap_is_not_bridged() -> None:
    """After a restart the events the journal lacked come again under their numbers: the
    fold keeps the first of each. An event past the next one is not joined to the fold
    (the client reads it as it reads a gap)."""

    async def scenario() -> None:
        inbox = _Inbox(each_event=False)
        for event in (_event(1, "a"), _event(2, "b"), _event(2, "b"), _event(1, "a")):
            inbox.put(event)
        inbox.put(_event(4, "d", finished=True))
        taken = await _woken(inbox)
        assert [(d.event, d.outputs[0].text) for d in taken] == [(2, "ab"), (4, "d")]

    asyncio.run(scenario())


def test_the_outputs_of_several_samples_fold_by_index_and_an_error_ends_the_fold() -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event=False)
        inbox.put(_event(1, "x", index=1))
        inbox.put(_event(2, "y", index=0))
        inbox.put(_event(3, "z", index=1))
        error = RequestDelta("r", 4, 4, finished=True, error="deadline", error_code="deadline")
        inbox.put(error)
        folded, last = await _woken(inbox)
        assert {out.index: out.text for out in folded.outputs} == {1: "xz", 0: "y"}
        assert (folded.event, folded.finished) == (3, False)
        assert last is error

    asyncio.run(scenario())


@pytest.mark.parametrize("item", [STEPPED_DOWN, RuntimeError("engine failed")])
def test_the_end_of_a_term_or_of_the_engine_wakes_every_client(item: object) -> None:
    async def scenario() -> None:
        inbox = _Inbox(each_event=False)
        inbox.put(RequestDelta("r", 4, 1))
        inbox.put(item)
        assert await _woken(inbox) == [RequestDelta("r", 4, 1), item]

    asyncio.run(scenario())
