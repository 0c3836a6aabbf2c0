"""A prompt list's streams merged (scheduler_svc/api/batch.py): outputs renumbered as
OpenAI numbers choices, and one stream's failure closes every other, as a client leaving
does, so no request of the batch runs on unseen."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from scheduler_svc.api.batch import merge, prompt_request_ids
from scheduler_svc.state.streams import RequestDelta, SeqDelta


def delta(request_id: str, event: int, indices: list[int]) -> RequestDelta:
    outputs = [SeqDelta(i, f"{request_id}:{i}", [event], [0.0], []) for i in indices]
    return RequestDelta(request_id, 3, event, outputs)


async def stream(request_id: str, events: int, closed: list[str], end: str = "finish"):
    """``events`` deltas, then the end: "finish", "fail", or "hang" (a request still running)."""
    try:
        for event in range(1, events + 1):
            await asyncio.sleep(0)
            yield delta(request_id, event, [0, 1])
        if end == "fail":
            raise RuntimeError(f"{request_id} failed")
        if end == "hang":
            await asyncio.Event().wait()
    finally:
        closed.append(request_id)


async def collect(merged: AsyncIterator[RequestDelta]) -> list[tuple[str, int]]:
    return [(out.text, out.index) async for d in merged for out in d.outputs]


def test_outputs_are_numbered_prompt_times_n_plus_sample() -> None:
    closed: list[str] = []
    streams = [stream(f"r-{i}", 2, closed) for i in range(3)]
    seen = asyncio.run(collect(merge(streams, n=2)))
    assert sorted(set(seen)) == [(f"r-{i}:{j}", i * 2 + j) for i in range(3) for j in (0, 1)]
    assert len(seen) == 12 and sorted(closed) == ["r-0", "r-1", "r-2"]


@pytest.mark.timeout(20)  # a stream left running would hang the merge
def test_a_failing_stream_closes_the_others() -> None:
    closed: list[str] = []
    streams = [stream("running", 1, closed, "hang"), stream("bad", 2, closed, "fail")]
    with pytest.raises(RuntimeError, match="bad failed"):
        asyncio.run(collect(merge(streams, n=2)))
    assert sorted(closed) == ["bad", "running"]


def test_one_prompt_is_its_own_stream_under_its_own_id() -> None:
    only = stream("r", 1, [])
    assert merge([only], n=4) is only
    assert prompt_request_ids("r", 1) == ["r"]
    assert prompt_request_ids("r", 3) == ["r-0", "r-1", "r-2"]
