"""The gRPC front door over loopback: in-process executor and engine, a real grpc.aio client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from executor_svc.executor import Executor
from pagedserve.model_files import load_tokenizer
from pagedserve.model_info import ModelInfo
from pagedserve.offline import OfflineLLM, Request
from pagedserve.rpc import GRPC_OPTIONS
from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1.frontdoor_pb2_grpc import FrontDoorStub
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from scheduler_svc.api.admission import ModelCard
from scheduler_svc.api.grpc_frontdoor import FrontDoorServicer, start_frontdoor
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.metrics import SchedulerMetrics
from tests.services import free_port

PROMPT = "The harbour committee met on a grey morning"


@pytest.fixture(scope="module")
def executor(tiny_chat_model_dir: Path) -> tuple[Executor, ModelInfo, Any]:
    config = ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    executor = Executor(config)
    return executor, executor.init_cache(), load_tokenizer(tiny_chat_model_dir)


def run(body: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    """Run an async test body in a fresh event loop (no pytest-asyncio here)."""
    asyncio.run(asyncio.wait_for(body, timeout))


@contextlib.asynccontextmanager
async def frontdoor(executor) -> AsyncIterator[tuple[FrontDoorStub, AsyncEngine]]:
    """A fresh engine over the shared executor, its SchedulerMetrics as the observer,
    served on a free loopback port."""
    ex, info, tokenizer = executor
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(max_num_batched_tokens=8192, max_model_len=info.max_model_len)
    engine = LLMEngine(ex, cache, sched, info.eos_token_id, Detokenizer(tokenizer))
    async_engine = AsyncEngine(engine, observer=SchedulerMetrics())
    await async_engine.start()
    card = ModelCard(info.model, info.vocab_size, info.max_model_len)
    port = free_port()
    server = await start_frontdoor(
        FrontDoorServicer(async_engine, tokenizer, card), "127.0.0.1", port
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        yield FrontDoorStub(channel), async_engine
    finally:
        await channel.close()
        await server.stop(None)
        await async_engine.stop()


async def collect(call: Any) -> list[pb.GenerateResponse]:
    """Read the stream to its end (read(), so it may follow an earlier call.read())."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def used_blocks(engine: AsyncEngine) -> int:
    return sum(e.scheduler.block_manager.gpu.num_used_blocks for e in engine.engines().values())


async def blocks_freed(engine: AsyncEngine, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while used_blocks(engine) or engine.has_unfinished():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def counted(engine: AsyncEngine, name: str, **labels: str) -> float:
    """A sample of the engine's metrics; ``name`` without ``pagedserve_``."""
    found = engine.observer.registry.get_sample_value(f"pagedserve_{name}", labels)
    assert found is not None, f"{name}{labels} missing"
    return found


async def counted_aborts(engine: AsyncEngine, expected: int, within: float = 5.0) -> float:
    """Requests counted as ended by an abort, once they reach ``expected`` (the count is
    taken between steps, a moment after the blocks are freed) or ``within`` passes."""
    deadline = time.monotonic() + within
    while counted(engine, "requests_total", finish_reason="abort") < expected:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return counted(engine, "requests_total", finish_reason="abort")


def test_greedy_stream_equals_the_in_process_engine(executor, tiny_chat_model_dir):
    llm = OfflineLLM(
        ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = llm.generate([Request("a", prompt=PROMPT, params=params)], progress=False)[0]

    async def body() -> None:
        async with frontdoor(executor) as (stub, _):
            request = pb.GenerateRequest(
                request_id="greedy", text=PROMPT, max_tokens=12, temperature=0, ignore_eos=True
            )
            responses = await collect(stub.Generate(request))
        assert len(responses) > 1 and {r.request_id for r in responses} == {"greedy"}
        choices = [c for r in responses for c in r.choices]
        assert {c.index for c in choices} == {0}
        assert "".join(c.text for c in choices) == offline.outputs[0].text
        assert [t for c in choices for t in c.token_ids] == offline.outputs[0].token_ids
        assert choices[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in choices[:-1])
        usage = responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            len(offline.prompt_token_ids),
            12,
        )

    run(body())


def test_n_with_a_seed_returns_repeatable_choices_and_logprobs(executor):
    async def body() -> None:
        async with frontdoor(executor) as (stub, engine):
            request = pb.GenerateRequest(
                text=PROMPT, max_tokens=6, n=2, seed=7, logprobs=2, ignore_eos=True
            )
            runs = [await collect(stub.Generate(request)) for _ in range(2)]
            assert await blocks_freed(engine)
        texts = []
        for responses in runs:
            by_index: dict[int, list[pb.CompletionDelta]] = {0: [], 1: []}
            for c in (c for r in responses for c in r.choices):
                by_index[c.index].append(c)
            assert all(sum(len(c.token_ids) for c in cs) == 6 for cs in by_index.values())
            tops = [t for cs in by_index.values() for c in cs for t in c.top_logprobs]
            assert len(tops) == 12 and all(len(t.entries) == 2 for t in tops)
            assert all(t.entries[0].logprob >= t.entries[1].logprob for t in tops)
            assert responses[-1].usage.completion_tokens == 12
            texts.append(["".join(c.text for c in by_index[i]) for i in (0, 1)])
        assert texts[0] == texts[1]
        assert runs[0][0].request_id.startswith("gen-")

    run(body())


BAD_REQUESTS = [
    (pb.GenerateRequest(max_tokens=4), "prompt"),
    (pb.GenerateRequest(text=""), "prompt"),
    (pb.GenerateRequest(token_ids=pb.PromptTokenIds()), "prompt"),
    (pb.GenerateRequest(token_ids=pb.PromptTokenIds(ids=[5, 49152])), "vocabulary [0, 49152)"),
    (pb.GenerateRequest(token_ids=pb.PromptTokenIds(ids=[-1])), "vocabulary"),
    (pb.GenerateRequest(text="hi", max_tokens=0), "'max_tokens' must be >= 1"),
    (pb.GenerateRequest(text="hi", n=0), "'n' must be in [1, 16]"),
    (pb.GenerateRequest(text="hi", n=17), "'n' must be in [1, 16]"),
    (pb.GenerateRequest(text="hi", n=3, best_of=2), "'best_of' (2) must be >= 'n' (3)"),
    (pb.GenerateRequest(text="hi", best_of=17), "'best_of' must be <= 16"),
    (pb.GenerateRequest(text="hi", temperature=-0.5), "'temperature' must be in [0, 2.0]"),
    (pb.GenerateRequest(text="hi", temperature=float("nan")), "'temperature'"),
    (pb.GenerateRequest(text="hi", top_p=0), "'top_p' must be in (0, 1]"),
    (pb.GenerateRequest(text="hi", top_k=0), "'top_k' must be -1 or >= 1"),
    (pb.GenerateRequest(text="hi", logprobs=21), "'logprobs' must be in [0, 20]"),
    (pb.GenerateRequest(text="hi", stop=[""]), "'stop'"),
    (pb.GenerateRequest(text="hi", max_tokens=2000), "max_tokens (2000)"),
    (pb.GenerateRequest(text="hi", max_tokens=2000), "maximum model length 1024"),
]


def test_bad_inputs_are_invalid_argument_naming_the_field(executor):
    async def body() -> None:
        async with frontdoor(executor) as (stub, engine):
            for request, expected in BAD_REQUESTS:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub.Generate(request))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
                assert expected in info.value.details(), (expected, info.value.details())
        assert not engine.has_unfinished() and used_blocks(engine) == 0

    run(body())


def test_an_executor_away_past_the_budget_is_unavailable(executor):
    async def body() -> None:
        async with frontdoor(executor) as (stub, engine):
            engine.executor_unavailable_for = lambda: 120.0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub.Generate(pb.GenerateRequest(text="hi")))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unreachable for 120 s" in info.value.details()

    run(body())


def test_a_cancelled_stream_frees_its_blocks(executor):
    async def body() -> None:
        async with frontdoor(executor) as (stub, engine):
            request = pb.GenerateRequest(text=PROMPT, max_tokens=900, ignore_eos=True)
            call = stub.Generate(request)
            first = await call.read()
            assert first.choices and used_blocks(engine) > 0
            call.cancel()
            assert await blocks_freed(engine), "the cancelled request still holds blocks"
            assert await counted_aborts(engine, 1) == 1
            assert counted(engine, "requests_total", finish_reason="length") == 0
            assert 0 < counted(engine, "generation_tokens_total") < request.max_tokens

    run(body())


def test_abort_ends_the_stream_with_abort(executor):
    async def body() -> None:
        async with frontdoor(executor) as (stub, engine):
            request = pb.GenerateRequest(
                request_id="to-abort", text=PROMPT, n=2, max_tokens=400, ignore_eos=True
            )
            call = stub.Generate(request)
            first = await call.read()
            answer = await stub.Abort(pb.AbortRequest(request_id="to-abort"))
            assert answer.aborted
            rest = await collect(call)
            assert rest[-1].usage.prompt_tokens > 0
            ends = {c.index: c.finish_reason for r in rest for c in r.choices if c.finish_reason}
            assert ends == {0: pb.FINISH_REASON_ABORT, 1: pb.FINISH_REASON_ABORT}
            tokens = [t for r in (first, *rest) for c in r.choices for t in c.token_ids]
            assert 0 < len(tokens) == rest[-1].usage.completion_tokens < 2 * request.max_tokens
            assert await blocks_freed(engine)
            assert await counted_aborts(engine, 1) == 1
            assert counted(engine, "generation_tokens_total") == len(tokens)
            unknown = await stub.Abort(pb.AbortRequest(request_id="never-sent"))
            assert not unknown.aborted

    run(body())
