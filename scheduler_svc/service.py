"""The scheduler process: connects to an executor, runs the engine loop, serves HTTP."""

from __future__ import annotations

import asyncio
import signal
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog
import uvicorn

from pagedserve.heap import tune_garbage_collector
from pagedserve.model_files import load_tokenizer, resolve_model
from pagedserve.redis_url import redacted
from pagedserve.registry import ExecutorRegistry
from pagedserve.rpc.tls import server_credentials
from pagedserve.settings import ApiConfig, SchedulerOptions, TlsOptions
from scheduler_svc.api.admission import ModelCard, sampling_defaults
from scheduler_svc.api.dashboard import Dashboard
from scheduler_svc.api.grpc_frontdoor import FrontDoorServicer, start_frontdoor
from scheduler_svc.api.http import Api, build_app
from scheduler_svc.api.keys import ApiKeys
from scheduler_svc.engine.admission import AdmissionLimits
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.engine.detokenizer import Detokenizer
from scheduler_svc.engine.engine import IdCounter, LLMEngine
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorUnavailable
from scheduler_svc.engine.lane_set import Fleet
from scheduler_svc.engine.reconnect import ReconnectingExecutor
from scheduler_svc.engine.step_observer import StepObservers
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.state.journal import Journal
from scheduler_svc.state.leader import lease_for
from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import InMemoryStateStore, StateStore

log = structlog.get_logger(__name__)

SHUTDOWN_POLL_S = 0.1  # how often a stopping server looks whether its executors are gone


class EngineFactory:
    """Builds the engine of each executor: the same model, tokenizer and id counter for
    all, each with its own block manager sized from that executor's pools."""

    def __init__(self, options: SchedulerOptions, store: StateStore, root_lane: str = "") -> None:
        """Args:
        root_lane: the executor whose state keeps the store's top-level keys (the
            single-executor layout); every other executor gets a lane of its own.
        """
        self.options = options
        self.store = store
        self.root_lane = root_lane
        self.seq_ids = IdCounter()
        self.tokenizer = None
        self.card: ModelCard | None = None

    def open_engine(self, address: str) -> LLMEngine:
        """Wait for the executor, allocate its pools (idempotent), build its engine."""
        options = self.options
        client = ExecutorClient(address, tls=options.tls)
        _wait_for_answer(client, options.connect_timeout_s)
        info = client.init_cache()  # a restarted scheduler gets the same pools
        if self.card is None:
            files = resolve_model(options.tokenizer or info.model)
            tokenizer = load_tokenizer(files)
            if tokenizer is None:
                raise ValueError(f"no tokenizer for {info.model}: pass --tokenizer PATH")
            if options.chat_template is not None:
                tokenizer.chat_template = Path(options.chat_template).read_text()
            self.tokenizer = tokenizer
            defaults = sampling_defaults(options.generation_config, files)
            self.card = ModelCard(info.model, info.vocab_size, info.max_model_len, defaults)
        elif info.model != self.card.name:
            raise ValueError(f"executor {address} serves {info.model}, not {self.card.name}")
        cache_config, scheduler_config = options.engine.configs(info)
        store = self.store if address == self.root_lane else self.store.lane(address)
        log.info(
            "executor ready",
            executor=address,
            model=info.model,
            gpu_blocks=info.num_gpu_blocks,
            cpu_blocks=info.num_cpu_blocks,
        )
        return LLMEngine(
            ReconnectingExecutor(client, info.instance_id),
            cache_config,
            scheduler_config,
            info.eos_token_id,
            Detokenizer(self.tokenizer),
            Journal(store),
            executor_instance=info.instance_id,
            seq_ids=self.seq_ids,
        )


def open_store(options: SchedulerOptions) -> StateStore:
    if options.state_store is None:
        return InMemoryStateStore(options.finished_ttl_s)
    store = RedisStateStore(
        options.state_store, options.namespace, finished_ttl_s=options.finished_ttl_s
    )
    if not store.ping():
        raise ValueError(f"no Redis answers at {redacted(options.state_store)}")
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


def _first_registered(registry: ExecutorRegistry, timeout: float) -> str:
    """The address of some live registered executor, waiting for one to register."""
    deadline = time.monotonic() + timeout
    while True:
        records, gone = registry.executors()
        live = sorted(a for a, r in records.items() if a not in gone and not r.draining)
        if live:
            return live[0]
        if time.monotonic() > deadline:
            raise ValueError(f"no executor registered in Redis within {timeout:.0f} s")
        time.sleep(0.5)


async def serve(options: SchedulerOptions, api_config: ApiConfig) -> int:
    """Run until SIGINT or SIGTERM, then stop the HTTP server and the engine loop.

    Returns the exit status: 1 when an engine loop failed (the process ends so that its
    supervisor restarts it, and the restart recovers from the store), else 0.
    """
    # Lane steps, store and registry calls each hold a worker thread while they wait.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(64, "pagedserve"))
    keys = ApiKeys.from_config(api_config)  # a bad key file stops the start, not a request
    store = open_store(options)
    registry = None
    if options.state_store is not None:
        registry = ExecutorRegistry(options.state_store, options.namespace)
    executors = options.executors
    if not executors and registry is None:
        executors = ("127.0.0.1:50051",)
    factory = EngineFactory(options, store, root_lane=executors[0] if len(executors) == 1 else "")
    # The model and tokenizer of the first executor; its engine judges requests while
    # this replica leads no lane.
    first = executors[0] if executors else None
    if first is None:
        first = await asyncio.to_thread(_first_registered, registry, options.connect_timeout_s)
    template = await asyncio.to_thread(factory.open_engine, first)
    fleet = Fleet(factory.open_engine, executors, registry, options.tls)
    lease = lease_for(store, options.lease_ttl) if registry is not None else None
    metrics, dashboard = SchedulerMetrics(), Dashboard()
    observers = StepObservers([metrics, dashboard])
    async_engine = AsyncEngine(
        fleet,
        observers,
        store,
        lease,
        template,
        options.routing,
        options.store_budget_s,
        AdmissionLimits(
            options.max_waiting_requests, options.max_waiting_tokens, options.max_queue_wait_s
        ),
        metrics.count_refused,
    )
    tune_garbage_collector()  # the tokenizer and the engines are built; no step has run
    await async_engine.start()
    tokenizer, card = factory.tokenizer, factory.card
    api = Api(async_engine, tokenizer, card, api_config, keys)
    app = build_app(api, metrics.render, dashboard)
    frontdoor = None
    if options.grpc_port is not None:
        servicer = FrontDoorServicer(async_engine, tokenizer, card, api_config, keys)
        credentials = server_credentials(options.tls, options.tls.tls_client_auth)
        frontdoor = await start_frontdoor(servicer, api_config.host, options.grpc_port, credentials)
    config = uvicorn.Config(
        app,
        host=api_config.host,
        port=api_config.port,
        log_level="warning",
        lifespan="off",
        **_https(options.tls),
    )
    server = uvicorn.Server(config)  # exits on SIGINT and SIGTERM
    scheme = "https" if options.tls.tls_http else "http"
    log.info("serving", url=f"{scheme}://{api_config.host}:{api_config.port}")
    watchdog = asyncio.create_task(_exit_when_dead(async_engine, server), name="watchdog")
    stranded = asyncio.create_task(_end_stranded_streams(async_engine, server), name="stranded")
    # uvicorn stops on SIGTERM or SIGINT, then raises the signal again under the handler
    # found before it started; a quiet one lets the cleanup below (and the caller's: the
    # executor `serve` started) run instead of the signal ending the process first.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore_signal)
    try:
        await server.serve()
    finally:
        watchdog.cancel()
        stranded.cancel()
        if frontdoor is not None:
            await frontdoor.stop(grace=5)
        await async_engine.stop()
    return 1 if async_engine.died.is_set() else 0


def _https(tls: TlsOptions) -> dict[str, object]:
    """uvicorn's TLS arguments: --tls-cert for HTTP with --tls-http, client certificates
    signed by --tls-ca with --tls-client-auth."""
    if not tls.tls_http:
        return {}
    args: dict[str, object] = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key}
    if tls.tls_client_auth:
        args |= {"ssl_ca_certs": tls.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return args


def _ignore_signal(signum: int, frame: object) -> None:
    """Only uvicorn's own handler acts on a stop signal while it serves."""


async def _end_stranded_streams(engine: AsyncEngine, server: uvicorn.Server) -> None:
    """Stopping, uvicorn waits for the streams in flight to finish, and the engine goes on
    stepping them; once its executors are gone too, none will finish: end them then."""
    while not server.should_exit:
        await asyncio.sleep(SHUTDOWN_POLL_S)
    while not engine.end_stranded_streams():
        await asyncio.sleep(SHUTDOWN_POLL_S)


async def _exit_when_dead(engine: AsyncEngine, server: uvicorn.Server) -> None:
    """Stop serving once the engine loop died: streams already got their error events."""
    await engine.died.wait()
    log.error("engine loop died; exiting for a restart")
    server.should_exit = True
