"""The executor's asyncio gRPC server: one Executor behind the Executor API and health."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import secrets
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from executor_svc import host_memory
from executor_svc.executor import Executor
from executor_svc.metrics import ExecutorMetrics
from executor_svc.registration import Registration
from executor_svc.step_guard import (
    InvalidArgument,
    PreconditionFailed,
    StepLedger,
    validate_followers,
    validate_pairs,
    validate_step,
)
from pagedserve.heap import tune_garbage_collector
from pagedserve.model_info import ExecutorStats, ModelInfo
from pagedserve.registry import ExecutorRecord
from pagedserve.rpc import GRPC_OPTIONS
from pagedserve.rpc.convert import (
    model_info_to_pb,
    pairs_from_pb,
    result_to_pb,
    stats_to_pb,
    step_from_pb,
)
from pagedserve.rpc.tls import add_port, server_credentials
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.rpc.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.settings import ExecutorConfig, RegistrationOptions, TlsOptions
from pagedserve.step import ExecuteStep, StepResult

log = structlog.get_logger("executor_svc.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
SHUTDOWN_GRACE_S = 60.0  # longest a running step may take to finish after SIGTERM
T = TypeVar("T")
# A status's message travels in trailing metadata, which gRPC caps (8 KiB by default): a
# refusal quoting a long field of the request would reach the client as RESOURCE_EXHAUSTED.
MAX_DETAILS_CHARS = 2000


@dataclasses.dataclass(slots=True)
class _Ran:
    """A step applied on the executor's thread, for the event loop to count (``_account``)."""

    step: ExecuteStep
    result: StepResult
    step_s: float  # inside the step: cache operations, forward passes, sampling
    overhead_s: float  # the executor's own time around it, on its thread
    read_s: float  # reading the call, while the step before ran
    displaced: object  # the applied step and the ledger entries it replaced


class ExecutorService(pb_grpc.ExecutorServicer):
    """Runs every pool operation on the thread that loaded the model, one at a time in
    the order the calls arrived (that thread's queue), so health checks answer while a
    step runs. A refused call changes nothing: not the pools, the ledger or the newest
    epoch seen.

    One thread for all torch work: OpenMP gives each thread that starts parallel regions a
    team of its own, and once the teams hold more threads than there are cores, libgomp's
    workers sleep almost at once between regions instead of spinning, which leaves cores
    idle and slows a CPU step.
    """

    def __init__(
        self, executor: Executor, health: health_aio.HealthServicer, thread: ThreadPoolExecutor
    ) -> None:
        self.executor = executor
        self.health = health
        self.thread = thread
        self.info: ModelInfo | None = None
        self.ledger = StepLedger()
        self._last_applied: tuple[ExecuteStep, StepResult] | None = None  # see _fill_followers
        self._applied: collections.deque[_Ran] = collections.deque()  # to count: _account
        self._loop = asyncio.get_running_loop()  # where they are counted
        self.stats = ExecutorStats(instance_id=secrets.token_hex(8))
        self.metrics = ExecutorMetrics()

    async def _queued(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: object
    ) -> T:
        """Run ``fn(*args)`` on the executor's thread once the calls queued before it ran;
        map refusals to statuses. The thread goes from one call to the next without waiting
        for this loop: a call sent ahead starts as soon as the one before it ends. One
        cancelled before it starts never runs."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)
        except InvalidArgument as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except PreconditionFailed as e:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except Exception as e:
            log.exception("executor.rpc_failed", rpc=getattr(fn, "__name__", "?"))
            code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
        await context.abort(code, _details(message))
        raise AssertionError("unreachable: abort raises")

    def _ready_info(self) -> ModelInfo:
        if self.info is None:
            raise PreconditionFailed("InitCache has not run: the pools are not allocated")
        return self.info

    async def InitCache(
        self, request: pb.InitCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.InitCacheResponse:
        """Allocate the pools once; a repeat answers the same facts and keeps the pools."""
        info = await self._queued(context, self._init_cache)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return model_info_to_pb(info)

    def _init_cache(self) -> ModelInfo:
        if self.info is None:
            info = self.executor.init_cache()
            self.info = dataclasses.replace(info, instance_id=self.stats.instance_id)
            s = self.stats
            s.ready, s.block_size = True, info.block_size
            s.num_gpu_blocks, s.num_cpu_blocks = info.num_gpu_blocks, info.num_cpu_blocks
            self.metrics.set_pools(info)
            log.info("executor.cache_allocated", **dataclasses.asdict(self.info))
        return self.info

    async def Execute(
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        """One step, idempotent by step id (see StepLedger for the replay and epoch rules).

        Read before it is queued, so that a step sent while another runs (async
        scheduling) is parsed meanwhile."""
        start = time.perf_counter()
        try:
            step = step_from_pb(request)
            validate_step(step, self._ready_info())
        except ValueError as e:  # a field refused (SamplingParams, or InvalidArgument)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(str(e)))
            raise AssertionError("unreachable: abort raises") from None
        except PreconditionFailed as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _details(str(e)))
            raise AssertionError("unreachable: abort raises") from None
        fingerprint = _fingerprint(request)
        read_s = time.perf_counter() - start
        result = await self._queued(context, self._execute, step, fingerprint, read_s)
        return result_to_pb(result)

    def _execute(self, step: ExecuteStep, fingerprint: bytes, read_s: float) -> StepResult:
        """Checked as read (``validate_step``), judged, and only then are its followers
        filled in and checked: a step that follows another is complete once the step
        before it ran. Nothing is mutated before the step is applied, so a refused call
        leaves the epoch, the ledger and the pools as they were, and the stats.

        The time spent here outside the step is the executor's own between two forward
        passes; ``read_s``, the time the call took to read, is counted with it. Counting
        the step, and freeing what it displaced, wait for the event loop (``_account``),
        which does them while the next step runs."""
        start = time.perf_counter()
        info = self._ready_info()
        if self.ledger.judge(step.step_id, step.epoch, fingerprint) is not None:
            return self._replay(step, fingerprint)
        self._fill_followers(step)
        validate_followers(step, info)
        result = self._apply(step, fingerprint, start, read_s)
        # Queued before the answer is handed over: the stats count the step when it is.
        self._loop.call_soon_threadsafe(self._account)
        return result

    def _fill_followers(self, step: ExecuteStep) -> None:
        """Give each sequence that ``follows`` the last token the previous step drew for it,
        at the position after that step's last one (the scheduler sent this step before
        it read that step's answer), and the table entries before ``table_start`` that
        step had."""
        followers = []
        for index, seq in enumerate(step.seqs):
            if seq.follows:
                followers.append((index, seq))
        if step.follows_step_id is None:
            if followers:
                raise InvalidArgument(f"seqs[{followers[0][0]}].follows: no follows_step_id")
            return
        last = self._last_applied
        if last is None or (last[0].step_id, last[0].epoch) != (step.follows_step_id, step.epoch):
            applied = "none" if last is None else f"step {last[0].step_id} of epoch {last[0].epoch}"
            raise PreconditionFailed(
                f"step {step.step_id} follows step {step.follows_step_id} of epoch {step.epoch}, "
                f"but the last applied is {applied}"
            )
        before, result = last
        outputs = {output.seq_id: output for output in result.outputs if output.token_ids}
        drawn = {
            seq.seq_id: (seq, outputs[seq.seq_id])
            for seq in before.seqs
            if seq.num_samples == 1 and seq.seq_id in outputs
        }
        for index, seq in followers:
            if seq.seq_id not in drawn:
                raise InvalidArgument(
                    f"seqs[{index}].follows: step {before.step_id} drew no token for "
                    f"seq {seq.seq_id}"
                )
            prior, output = drawn[seq.seq_id]
            if seq.table_start > len(prior.block_table):
                raise InvalidArgument(
                    f"seqs[{index}].table_start: {seq.table_start} entries kept of a table "
                    f"of {len(prior.block_table)} in step {before.step_id}"
                )
            if seq.table_start:
                seq.block_table = prior.block_table[: seq.table_start] + seq.block_table
            seq.new_token_ids = [output.token_ids[-1]]
            seq.num_computed_tokens = prior.context_len + len(output.token_ids) - 1

    def _replay(self, step: ExecuteStep, fingerprint: bytes) -> StepResult:
        result = self.ledger.adopt(step.step_id, step.epoch, fingerprint)
        self.stats.epoch = self.ledger.epoch
        self.stats.num_replayed_steps += 1
        self.metrics.replayed_steps.inc()
        log.info("executor.step_replayed", step_id=step.step_id, epoch=step.epoch)
        return result

    def _apply(
        self, step: ExecuteStep, fingerprint: bytes, start: float, read_s: float
    ) -> StepResult:
        """Run the step and record it; queue it to be counted (``start``: when its call
        began on this thread). Only the queue holds what it displaced once this returns."""
        begin = time.perf_counter()
        result = self.executor.execute(step)
        end = time.perf_counter()
        dropped = self.ledger.record(step.step_id, step.epoch, fingerprint, result)
        previous, self._last_applied = self._last_applied, (step, result)
        overhead_s = time.perf_counter() - start - (end - begin)
        self._applied.append(
            _Ran(step, result, end - begin, overhead_s, read_s, (previous, dropped))
        )
        return result

    def _account(self) -> None:
        """Count the steps applied since in the stats and metrics, on the event loop; what
        they displaced is freed here rather than before the next forward pass."""
        s = self.stats
        while self._applied:
            ran = self._applied.popleft()
            step = ran.step
            s.epoch, s.num_steps = self.ledger.epoch, s.num_steps + 1
            s.last_step_id, s.last_step_seconds = step.step_id, ran.step_s
            s.total_step_seconds += ran.step_s
            s.total_overhead_seconds += ran.overhead_s
            s.total_read_seconds += ran.read_s
            s.num_blocks_swapped_out += len(step.blocks_to_swap_out)
            s.num_blocks_swapped_in += len(step.blocks_to_swap_in)
            s.num_blocks_copied += len(step.blocks_to_copy)
            self.metrics.observe_step(step, ran.result, ran.step_s)
            self.metrics.observe_overhead(ran.overhead_s, ran.read_s)

    async def Fence(
        self, request: pb.FenceRequest, context: grpc.aio.ServicerContext
    ) -> pb.FenceResponse:
        """Queued like a step: a step of the old leader that arrived before it ends before
        the fence answers (and shows in ``last_step_id``); one that arrives later is refused."""
        last_step_id = await self._queued(context, self._fence, request.epoch)
        return pb.FenceResponse(last_step_id=last_step_id)

    def _fence(self, epoch: int) -> int | None:
        last_step_id = self.ledger.fence(epoch)
        self.stats.epoch = self.ledger.epoch
        log.info("executor.fenced", epoch=epoch, last_step_id=last_step_id)
        return last_step_id

    async def EndSteps(
        self, request: pb.EndStepsRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndStepsResponse:
        """Not queued: the step it ends runs on the executor's thread meanwhile; the steps sent
        after it (up to ``step_id``) end after their first step too."""
        self.executor.end_steps(request.step_id, self.ledger.epoch)
        return pb.EndStepsResponse()

    async def CopyBlocks(
        self, request: pb.CopyBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.CopyBlocksResponse:
        """Copy-on-write pairs outside a step; counted in the stats like a step's."""
        num = await self._queued(context, self._copy_blocks, pairs_from_pb(request.blocks_to_copy))
        return pb.CopyBlocksResponse(num_copied=num)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> int:
        info = self._ready_info()
        validate_pairs(pairs, "blocks_to_copy", info.num_gpu_blocks, info.num_gpu_blocks)
        self.executor.copy_blocks(pairs)
        self.stats.num_blocks_copied += len(pairs)
        self.metrics.observe_cache_ops([], [], pairs)
        return len(pairs)

    async def SwapBlocks(
        self, request: pb.SwapBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.SwapBlocksResponse:
        """Swap out, then swap in, outside a step; counted in the stats like a step's."""
        out = pairs_from_pb(request.blocks_to_swap_out)
        into = pairs_from_pb(request.blocks_to_swap_in)
        num_out, num_in = await self._queued(context, self._swap_blocks, out, into)
        return pb.SwapBlocksResponse(num_swapped_out=num_out, num_swapped_in=num_in)

    def _swap_blocks(
        self, out: list[tuple[int, int]], into: list[tuple[int, int]]
    ) -> tuple[int, int]:
        info = self._ready_info()
        gpu, cpu = info.num_gpu_blocks, info.num_cpu_blocks
        validate_pairs(out, "blocks_to_swap_out", gpu, cpu)
        validate_pairs(into, "blocks_to_swap_in", cpu, gpu)
        self.executor.swap_blocks(out, into)
        self.stats.num_blocks_swapped_out += len(out)
        self.stats.num_blocks_swapped_in += len(into)
        self.metrics.observe_cache_ops(out, into)
        return len(out), len(into)

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        """Not queued: counters only, never the pools."""
        return stats_to_pb(self.stats)


def _details(message: str) -> str:
    """A refusal's message, cut to what a status carries."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return message[:MAX_DETAILS_CHARS] + f"... ({len(message)} characters)"


def _fingerprint(request: pb.ExecuteRequest) -> bytes:
    """Digest of the step's content without its epoch: tells a replay from a new step."""
    epoch = request.epoch
    request.epoch = 0
    try:
        data = request.SerializeToString(deterministic=True)
    finally:
        request.epoch = epoch
    return hashlib.blake2b(data, digest_size=16).digest()


async def _serve(
    executor: Executor,
    thread: ThreadPoolExecutor,
    host: str,
    port: int,
    registration: RegistrationOptions | None,
    metrics_port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    health = health_aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    service = ExecutorService(executor, health, thread)
    # No SO_REUSEPORT: a second executor on a taken port must fail, not share the traffic.
    server = grpc.aio.server(options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
    pb_grpc.add_ExecutorServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:{port}"
    try:
        bound = add_port(server, address, credentials)
    except RuntimeError as e:  # grpc's way of saying the address is taken or invalid
        raise OSError(f"cannot listen on {address}: {e}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    log.info("executor.listening", address=f"{host}:{bound}", instance_id=service.stats.instance_id)
    service.metrics.serve(host, metrics_port)
    announcer = None
    if registration is not None:
        record = ExecutorRecord(
            address=registration.address(host, bound),
            model=executor.config.model,
            block_size=executor.config.block_size,
            instance_id=service.stats.instance_id,
        )
        announcer = Registration(registration, record)
        heartbeat = asyncio.create_task(announcer.run(stop), name="registry-heartbeat")
    await stop.wait()
    if announcer is not None:
        await heartbeat
        await announcer.drain()  # still SERVING: the leader finishes or moves our requests
    log.info("executor.stopping", grace_s=SHUTDOWN_GRACE_S)
    await health.enter_graceful_shutdown()
    # Refuses new calls and lets the running step finish; a step still running past the
    # grace keeps the executor's thread, which serve() waits for before closing the executor.
    await server.stop(SHUTDOWN_GRACE_S)
    log.info("executor.stopped", num_steps=service.stats.num_steps)


def serve(
    config: ExecutorConfig,
    host: str = "127.0.0.1",
    port: int = 50051,
    registration: RegistrationOptions | None = None,
    metrics_port: int = 9100,
    make_executor: Callable[[ExecutorConfig], Executor] = Executor,
    tls: TlsOptions | None = None,
) -> int:
    """Load the model, then serve until SIGTERM or SIGINT; returns the exit status.

    With ``registration`` the executor announces itself in Redis and drains on SIGTERM.
    Prometheus metrics are served on ``metrics_port`` (0: not at all). ``make_executor``
    builds the executor on its thread (bench/standin_executor.py: a forward pass that
    only sleeps, to measure everything around it). With ``tls`` the port is served over
    TLS; given a CA it refuses every client without a certificate that CA signed.
    """
    log.info(
        "executor.loading",
        model=config.model,
        device=config.device,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    # Read before the model loads: a missing certificate fails the start at once.
    credentials = None if tls is None else server_credentials(tls, tls.tls_ca is not None)
    start = time.perf_counter()
    host_memory.one_malloc_arena()  # before the step thread's first allocation
    with ThreadPoolExecutor(1, thread_name_prefix="executor") as thread:  # see ExecutorService
        executor = thread.submit(make_executor, config).result()
        log.info("executor.loaded", seconds=round(time.perf_counter() - start, 2))
        tune_garbage_collector()
        try:
            asyncio.run(
                _serve(executor, thread, host, port, registration, metrics_port, credentials)
            )
        except OSError as e:
            log.error("executor.failed", error=str(e))
            return 1
        finally:
            thread.submit(executor.close).result()  # the tensor-parallel workers, if any
    return 0
