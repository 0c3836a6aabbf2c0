"""A client re-attaching to a running request gets every event after the one it names,
even an event the leader published before the client listened and committed after the
client read the store (events are committed with the next step)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.state.state_store import InMemoryStateStore, StepCommit
from scheduler_svc.state.store_stream import request_record

REQUEST, HELD_EVENT, MAX_TOKENS = "resumed", 4, 8


class GatedStore(InMemoryStateStore):
    """Holds the commit that carries one event of one request until released."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = threading.Event()
        self.release = threading.Event()

    def commit(self, commit: StepCommit) -> bool:
        events = [json.loads(text)["event"] for rid, text in commit.events if rid == REQUEST]
        if HELD_EVENT in events:
            self.holding.set()
            self.release.wait(30)
        return super().commit(commit)


def test_an_event_published_before_the_client_listened_is_not_lost(
    journaled_engine: Callable[..., LLMEngine],
) -> None:
    store = GatedStore()
    engine = journaled_engine(store, num_decode_steps=1)  # an event per token
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = [100, 200, 300, 400]

    async def body() -> list[int]:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            # Submitted by another replica; this one leads and runs it.
            store.submit_request(REQUEST, request_record(prompt, params, time.time()))
            assert await asyncio.to_thread(store.holding.wait, 30)
            # Event HELD_EVENT is published, its commit held: the client reads the store
            # (events up to HELD_EVENT - 1) and only then listens.
            got = []

            async def follow() -> None:
                async for delta in async_engine.generate(REQUEST, prompt, params, 1):
                    got.append(delta.event)

            task = asyncio.create_task(follow())
            await asyncio.sleep(0.2)
            store.release.set()
            await task
            return got
        finally:
            store.release.set()
            await async_engine.stop()

    got = asyncio.run(asyncio.wait_for(body(), 60))
    assert got == list(range(2, MAX_TOKENS + 1))
