"""A client re-attaching to a running request gets every event after the one it names,
even an event the leader published before the client listened and committed after the
client read the store (events are committed with the next step)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from executor_svc.executor import Executor
from pagedserve.model_files import load_tokenizer
from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from scheduler_svc.async_engine import AsyncEngine
from scheduler_svc.detokenizer import Detokenizer
from scheduler_svc.engine import LLMEngine
from scheduler_svc.journal import Journal
from scheduler_svc.state_store import InMemoryStateStore, StepCommit
from scheduler_svc.store_stream import request_record

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


@pytest.fixture(scope="module")
def executor(tiny_chat_model_dir: Path) -> tuple[Executor, ModelInfo]:
    config = ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    executor = Executor(config)
    return executor, executor.init_cache()


def test_an_event_published_before_the_client_listened_is_not_lost(
    executor: tuple[Executor, ModelInfo], tiny_chat_model_dir: Path
) -> None:
    store = GatedStore()
    ex, info = executor
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=info.max_model_len)
    detokenizer = Detokenizer(load_tokenizer(tiny_chat_model_dir))
    engine = LLMEngine(ex, cache, sched, info.eos_token_id, detokenizer, Journal(store))
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
