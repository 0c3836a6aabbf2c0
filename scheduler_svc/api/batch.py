"""A prompt list as engine requests: each prompt runs as a request of its own, and their
outputs come back as one stream with the choice indices OpenAI gives them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from scheduler_svc.state.streams import RequestDelta


def prompt_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine's id for each prompt: the request's own for a single prompt, else
    ``ID-i`` for prompt i, so a retried request id finds each of its prompts again."""
    if num_prompts == 1:
        return [request_id]
    return [f"{request_id}-{i}" for i in range(num_prompts)]


def merge(streams: list[AsyncIterator[RequestDelta]], n: int) -> AsyncIterator[RequestDelta]:
    """The deltas of every stream as they come, output j of stream i numbered i * n + j.
    Closing the merged stream, or a failure of any one, closes them all: every request
    of the batch is aborted with it."""
    return streams[0] if len(streams) == 1 else _interleave(streams, n)


_DONE = object()  # a stream's end, in the queue of _interleave


async def _interleave(
    streams: list[AsyncIterator[RequestDelta]], n: int
) -> AsyncIterator[RequestDelta]:
    queue: asyncio.Queue[RequestDelta | Exception | object] = asyncio.Queue()

    async def pump(offset: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put(_renumbered(delta, offset))
            await queue.put(_DONE)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i * n, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item  # type: ignore[misc]
    finally:  # cancelling a pump ends its stream where it waits, which aborts its request
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _renumbered(delta: RequestDelta, offset: int) -> RequestDelta:
    if offset == 0:
        return delta
    outputs = [replace(out, index=out.index + offset) for out in delta.outputs]
    return replace(delta, outputs=outputs)
