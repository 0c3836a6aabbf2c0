"""An in-process executor on the tiny chat model, and an engine journaling to a store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from executor_svc.executor import Executor
from pagedserve.model_files import load_tokenizer
from pagedserve.model_info import ModelInfo
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import LLMEngine
from scheduler_svc.state.journal import Journal
from scheduler_svc.state.state_store import StateStore


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
    running ``num_decode_steps`` decode steps per executor call when it can."""
    ex, info = tiny_executor
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    detokenizer = Detokenizer(load_tokenizer(tiny_chat_model_dir))

    def build(store: StateStore, num_decode_steps: int = 4) -> LLMEngine:
        sched = SchedulerConfig(
            max_num_batched_tokens=8192,
            max_model_len=info.max_model_len,
            num_decode_steps=num_decode_steps,
        )
        return LLMEngine(ex, cache, sched, info.eos_token_id, detokenizer, Journal(store))

    return build
