"""The scheduler process: connects to an executor, runs the engine loop, serves HTTP."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
import uvicorn

from pagedserve.model_files import load_tokenizer, resolve_model
from pagedserve.settings import ApiConfig, CacheConfig, PreemptionMode, SchedulerConfig
from scheduler_svc.api.grpc_frontdoor import FrontDoorServicer, start_frontdoor
from scheduler_svc.api.http import Api, ModelCard, build_app
from scheduler_svc.async_engine import AsyncEngine
from scheduler_svc.detokenizer import Detokenizer
from scheduler_svc.engine import LLMEngine
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.journal import Journal
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.reconnect import ReconnectingExecutor
from scheduler_svc.redis_store import RedisStateStore
from scheduler_svc.state_store import InMemoryStateStore, StateStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SchedulerOptions:
    executor: str = "127.0.0.1:50051"
    tokenizer: str | None = None  # default: the executor's model
    connect_timeout: float = 600.0  # the executor may still be loading its model
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    preemption_mode: PreemptionMode | None = None
    enable_prefix_caching: bool = False
    state_store: str | None = None  # redis://HOST:PORT/DB; default: in this process
    namespace: str = "pagedserve"  # Redis key prefix of this deployment
    grpc_port: int | None = None  # the gRPC Generate front door; None: HTTP only


def build_engine(options: SchedulerOptions) -> tuple[LLMEngine, ModelCard, object]:
    """Wait for the executor, size the block manager from its pools, load the tokenizer."""
    client = ExecutorClient(options.executor)
    _wait_for_answer(client, options.connect_timeout)
    info = client.init_cache()  # idempotent: a restarted scheduler gets the same pools
    tokenizer = load_tokenizer(resolve_model(options.tokenizer or info.model))
    if tokenizer is None:
        raise ValueError(f"no tokenizer for {info.model}: pass --tokenizer PATH")
    cache_config = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
        enable_prefix_caching=options.enable_prefix_caching,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens or max(8192, info.max_model_len),
        max_model_len=info.max_model_len,
        preemption_mode=options.preemption_mode,
    )
    engine = LLMEngine(
        ReconnectingExecutor(client, info.instance_id),
        cache_config,
        scheduler_config,
        info.eos_token_id,
        Detokenizer(tokenizer),
        Journal(open_store(options)),
        executor_instance=info.instance_id,
    )
    card = ModelCard(info.model, info.vocab_size, info.max_model_len)
    log.info(
        "engine ready",
        executor=options.executor,
        model=info.model,
        gpu_blocks=info.num_gpu_blocks,
        cpu_blocks=info.num_cpu_blocks,
    )
    return engine, card, tokenizer


def open_store(options: SchedulerOptions) -> StateStore:
    if options.state_store is None:
        return InMemoryStateStore()
    if not options.state_store.startswith("redis://"):
        raise ValueError(f"--state-store must be a redis:// URL, got {options.state_store!r}")
    store = RedisStateStore(options.state_store, options.namespace)
    if not store.ping():
        raise ValueError(f"no Redis answers at {options.state_store}")
    return store


def _wait_for_answer(client: ExecutorClient, timeout: float) -> None:
    """Until the executor's health service answers at all: it reports SERVING only after
    InitCache, which is ours to send."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.health(timeout=1.0)
            return
        except ExecutorUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def serve(options: SchedulerOptions, api_config: ApiConfig) -> None:
    """Run until SIGINT or SIGTERM, then stop the HTTP server and the engine loop."""
    engine, card, tokenizer = await asyncio.to_thread(build_engine, options)
    metrics = SchedulerMetrics()
    metrics.update(engine)
    async_engine = AsyncEngine(engine, metrics)
    await async_engine.start()
    app = build_app(Api(async_engine, tokenizer, card, api_config), metrics.render)
    frontdoor = None
    if options.grpc_port is not None:
        servicer = FrontDoorServicer(async_engine, tokenizer, card, api_config)
        frontdoor = await start_frontdoor(servicer, api_config.host, options.grpc_port)
    config = uvicorn.Config(
        app, host=api_config.host, port=api_config.port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)  # exits on SIGINT and SIGTERM
    log.info("serving", url=f"http://{api_config.host}:{api_config.port}")
    try:
        await server.serve()
    finally:
        if frontdoor is not None:
            await frontdoor.stop(grace=5)
        await async_engine.stop()
