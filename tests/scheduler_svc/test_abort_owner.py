"""An abort on behalf of an owner stops only that owner's requests: the owner is written
into the submitted record, and AsyncEngine.abort(owner=...) compares it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.state.state_store import InMemoryStateStore


def test_an_abort_stops_only_its_owners_requests(
    journaled_engine: Callable[..., LLMEngine],
) -> None:
    store = InMemoryStateStore()
    engine = journaled_engine(store, num_decode_steps=1)  # an event per token
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            deltas = async_engine.generate("theirs", [100, 200, 300], params, owner="alice")
            await anext(deltas)
            assert json.loads(store.get_request("theirs"))["owner"] == "alice"
            assert not async_engine.abort("theirs", owner="bob")
            assert not async_engine.abort("never-sent", owner="alice")
            assert not (await anext(deltas)).finished  # bob's abort stopped nothing
            assert async_engine.abort("theirs", owner="alice")
            rest = [d async for d in deltas]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
            assert sum(len(d.outputs[0].token_ids) for d in rest) < 100
        finally:
            await async_engine.stop()

    asyncio.run(asyncio.wait_for(body(), 60))
