"""An in-process executor on the tiny chat model, an engine journaling to a store, and a
served one behind an API key for the tests that throw hostile input at it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from executor_svc.executor import Executor
from pagedserve.model_files import load_tokenizer
from pagedserve.model_info import ModelInfo
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.state.journal import Journal
from scheduler_svc.state.state_store import StateStore
from tests.services import GUARD_KEY, free_port, serving


@pytest.fixture(scope="session")
def guarded_server(tiny_chat_model_dir: Path) -> Iterator[SimpleNamespace]:
    """`pagedserve serve` with API key GUARD_KEY and the gRPC front door: url, model, an
    HTTP client, a gRPC channel and the process. Shared: every test leaves it serving and
    drained."""
    grpc_port = free_port()
    flags = ["--num-gpu-blocks", "96", "--api-key", GUARD_KEY, "--grpc-port", str(grpc_port)]
    with serving(tiny_chat_model_dir, *flags, "--executor-metrics-port", "0") as proc:
        url = proc.url
        auth = {"Authorization": f"Bearer {GUARD_KEY}"}
        model = httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        client = httpx.Client(base_url=url, timeout=60)
        with client, grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield SimpleNamespace(url=url, model=model, client=client, channel=channel, proc=proc)


@pytest.fixture(scope="module")
def tiny_executor(tiny_chat_model_dir: Path) -> tuple[Executor, ModelInfo]:
    config = ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    executor = Executor(config)
    return executor, executor.init_cache()


@pytest.fixture
def journaled_engine(
    tiny_executor: tuple[Executor, ModelInfo], tiny_chat_model_dir: Path
) -> Callable[..., LLMEngine]:
    """Builds an engine on the tiny executor that commits every step to the given store,
    running ``num_decode_steps`` decode steps per executor call when it can, and prompts
    in chunks past ``max_num_batched_tokens``."""
    ex, info = tiny_executor
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    detokenizer = Detokenizer(load_tokenizer(tiny_chat_model_dir))

    def build(
        store: StateStore, num_decode_steps: int = 4, max_num_batched_tokens: int = 8192
    ) -> LLMEngine:
        sched = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=info.max_model_len,
            num_decode_steps=num_decode_steps,
        )
        return LLMEngine(ex, cache, sched, info.eos_token_id, detokenizer, Journal(store))

    return build
