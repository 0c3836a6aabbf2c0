"""One request's failure is that request's, a store that does not answer is waited out, and
an engine loop that cannot go on says so: the engine in this process on the tiny model,
journaling to an in-process store (the services' versions run in test_store_outage.py)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import pytest

from pagedserve.grammar import Grammar
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, StepResult
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.state.state_store import InMemoryStateStore, StepCommit, StoreUnavailableError
from scheduler_svc.state.streams import EngineDeadError, RequestDelta, RequestFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [100, 200, 300, 400]


class FlakyStore(InMemoryStateStore):
    """Refuses every ``every``-th commit attempt as unreachable, landing some first (as a
    reply lost on the way back would)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every, self.attempts, self.refused = every, 0, 0

    def commit(self, commit: StepCommit) -> bool:
        self.attempts += 1
        if self.attempts % self.every:
            return super().commit(commit)
        if self.refused % 2:
            super().commit(commit)
        self.refused += 1
        raise StoreUnavailableError("no answer")


async def collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list:
    return [d async for d in engine.generate(request_id, PROMPT, params)]


def text_of(deltas: list[RequestDelta]) -> str:
    return "".join(out.text for d in deltas for out in d.outputs)


def run(engine: LLMEngine, body: Callable) -> object:
    async def main() -> object:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            return await asyncio.wait_for(body(async_engine), 120)
        finally:
            await async_engine.stop()

    return asyncio.run(main())


def test_commits_are_resent_until_the_store_answers(journaled_engine) -> None:
    store = FlakyStore(every=3)
    reference = run(journaled_engine(InMemoryStateStore()), lambda e: collect(e, "r", GREEDY))
    got = run(journaled_engine(store, 1), lambda e: collect(e, "r", GREEDY))
    assert store.refused > 2
    assert text_of(got) == text_of(reference) and got[-1].finished


def test_a_request_that_cannot_be_journaled_ends_alone(journaled_engine) -> None:
    """A lone surrogate in a stop string passes SamplingParams but not the journal: that
    request ends with an error event, the one beside it finishes."""
    store = InMemoryStateStore()
    poison = SamplingParams(max_tokens=4, stop=("a\ud800b",))

    async def body(engine: AsyncEngine) -> list:
        bad = collect(engine, "bad", poison)
        return await asyncio.gather(bad, collect(engine, "ok", GREEDY), return_exceptions=True)

    failure, ok = run(journaled_engine(store), body)
    assert isinstance(failure, RequestFailedError) and failure.code == "request_failed"
    assert "cannot be journaled" in str(failure)
    assert ok[-1].finished and ok[-1].error is None and text_of(ok)
    assert [RequestDelta.from_json(e).error for _, e in store.read_events("bad")] == [str(failure)]
    assert store.pending_requests() == [] and store.load().groups == {}


def test_a_grammar_the_executor_cannot_use_ends_its_request_alone(journaled_engine) -> None:
    """Where the scheduler has no grammar engine to check a request with (its image), the
    executor leaves a grammar it cannot compile out of the step: that request ends with an
    ``invalid_grammar`` error (a 400), the constrained one beside it finishes, and so does
    one that started before."""
    store = InMemoryStateStore()
    unclosed = SamplingParams(max_tokens=4, grammar=Grammar("regex", "(unclosed"))
    dates = SamplingParams(max_tokens=40, grammar=Grammar("regex", r"[0-9]{4}-[0-9]{2}"))

    async def body(engine: AsyncEngine) -> list:
        ok = asyncio.create_task(collect(engine, "ok", GREEDY))
        await asyncio.sleep(0.2)
        bad = collect(engine, "bad", unclosed)
        good = collect(engine, "date", dates)
        return await asyncio.gather(bad, good, ok, return_exceptions=True)

    failure, date, ok = run(journaled_engine(store), body)
    assert isinstance(failure, RequestFailedError) and failure.code == "invalid_grammar"
    assert "does not compile" in str(failure)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", text_of(date)), text_of(date)
    assert ok[-1].finished and ok[-1].error is None and len(text_of(ok)) > 0
    assert store.pending_requests() == [] and store.load().groups == {}


class BrokenExecutor:
    def execute(self, step: ExecuteStep) -> StepResult:
        raise RuntimeError("the device fell off")


def test_an_engine_loop_that_fails_ends_every_stream_and_asks_to_exit(journaled_engine) -> None:
    engine = journaled_engine(InMemoryStateStore())
    engine.executor = BrokenExecutor()

    async def body(async_engine: AsyncEngine) -> bool:
        with pytest.raises(EngineDeadError, match="fell off"):
            await collect(async_engine, "r", GREEDY)
        await asyncio.wait_for(async_engine.died.wait(), 5)
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "later", GREEDY)
        return async_engine.is_running

    start = time.monotonic()
    assert run(engine, body) is False
    assert time.monotonic() - start < 60
