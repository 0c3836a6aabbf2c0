"""The scheduler's synchronous gRPC client of one executor; a StepExecutor for the engine."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.model_info import ExecutorStats, ModelInfo
from pagedserve.rpc import GRPC_OPTIONS
from pagedserve.rpc.convert import (
    EXECUTOR_PROTOCOL,
    ParamsCache,
    model_info_from_pb,
    pairs_to_pb,
    result_from_pb,
    stats_from_pb,
    step_to_pb,
)
from pagedserve.rpc.tls import executor_channel
from pagedserve.rpc.v1 import executor_pb2 as pb
from pagedserve.rpc.v1 import executor_pb2_grpc as pb_grpc
from pagedserve.settings import TlsOptions
from pagedserve.step import BlockPairs, ExecuteStep, StepResult

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


class ExecutorError(Exception):
    """An executor call failed; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class ExecutorUnavailable(ExecutorError):
    """Unreachable, too slow or stopping (UNAVAILABLE, DEADLINE_EXCEEDED, and CANCELLED: a
    stopping executor cancels the calls queued behind its step; this client cancels none):
    the call may or may not have been applied; resending the same step is safe while the
    instance id is unchanged."""


class StepRefused(ExecutorError):
    """Refused before anything was applied (INVALID_ARGUMENT, FAILED_PRECONDITION): a bug
    or a stale scheduler; resending the same request will not help."""


class ExecutorIncompatible(ValueError):
    """The executor speaks another revision of the executor API (another pagedserve
    version): steps would be misread, so it is not used."""


_ERRORS: dict[grpc.StatusCode, type[ExecutorError]] = {
    grpc.StatusCode.UNAVAILABLE: ExecutorUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ExecutorUnavailable,
    grpc.StatusCode.CANCELLED: ExecutorUnavailable,
    grpc.StatusCode.INVALID_ARGUMENT: StepRefused,
    grpc.StatusCode.FAILED_PRECONDITION: StepRefused,
}


def _error(e: grpc.RpcError) -> ExecutorError:
    code, details = e.code(), e.details() or ""
    return _ERRORS.get(code, ExecutorError)(code, details)


class ExecutorClient:
    """Blocking client of one executor at ``address`` ("host:port"), one deadline per call.

    It never retries on its own: only the engine knows whether a step may be resent. An
    Execute's deadline is an hour, a bound on a wedged step rather than a liveness check:
    an executor that goes away fails the call within two keepalive pings (GRPC_OPTIONS).
    """

    def __init__(
        self,
        address: str,
        execute_timeout: float = 3600.0,
        call_timeout: float = 10.0,
        init_timeout: float = 300.0,
        tls: TlsOptions | None = None,
    ) -> None:
        self.address = address
        self.execute_timeout = execute_timeout
        self.call_timeout = call_timeout
        self.init_timeout = init_timeout  # allocating a large pool takes a while
        self._channel = executor_channel(address, tls, GRPC_OPTIONS)
        self._stub = pb_grpc.ExecutorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._params: ParamsCache = {}  # the last step's sampling parameters, converted
        self._ending: set[grpc.Future] = set()  # EndSteps calls not answered yet

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise _error(e) from None

    def init_cache(self) -> ModelInfo:
        """Allocate the executor's pools (once per executor process) and describe the model.
        Raises ExecutorIncompatible for an executor of another API revision."""
        response = self._call(self._stub.InitCache, pb.InitCacheRequest(), self.init_timeout)
        if response.protocol != EXECUTOR_PROTOCOL:
            raise ExecutorIncompatible(
                f"executor {self.address} speaks revision {response.protocol} of the executor "
                f"API, this scheduler {EXECUTOR_PROTOCOL}: run one pagedserve version on both"
            )
        return model_info_from_pb(response)

    def execute(self, step: ExecuteStep) -> StepResult:
        """Run one step. Raises ExecutorUnavailable or StepRefused (see their docs)."""
        return self.start(step)()

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        """Send one step and return at once; calling the result waits for the step's
        answer and raises as ``execute`` does. The caller may work meanwhile (the engine
        writes its journal while the executor computes)."""
        request = step_to_pb(step, self._params)
        future = self._stub.Execute.future(request, timeout=self.execute_timeout)

        def result() -> StepResult:
            try:
                response = future.result()
            except grpc.RpcError as e:
                raise _error(e) from None
            if response.step_id != step.step_id:
                raise ExecutorError(
                    grpc.StatusCode.INTERNAL, f"sent step {step.step_id}, got {response.step_id}"
                )
            return result_from_pb(response)

        return result

    def fence(self, epoch: int) -> int | None:
        """Have the executor refuse steps of epochs before ``epoch`` from now on; returns
        the id of the last step it applied (None: none). Raises StepRefused when it has
        seen a newer epoch."""
        response = self._call(self._stub.Fence, pb.FenceRequest(epoch=epoch), self.call_timeout)
        return response.last_step_id if response.HasField("last_step_id") else None

    def end_steps(self, step_id: int) -> grpc.Future:
        """Ask step ``step_id`` to stop its decode steps in a row early; returns at once.
        The engine does not wait for the answer: the step answers what it drew either way.
        The call is held here until answered: gRPC cancels one whose future is collected,
        often before it left, and the calls in a row then ran to their end."""
        request = pb.EndStepsRequest(step_id=step_id)
        future = self._stub.EndSteps.future(request, timeout=self.call_timeout)
        self._ending.add(future)
        future.add_done_callback(self._ending.discard)
        return future

    def copy_blocks(self, blocks_to_copy: BlockPairs) -> int:
        """Copy ``(src, dst)`` blocks inside the KV pool; returns how many."""
        request = pb.CopyBlocksRequest(blocks_to_copy=pairs_to_pb(blocks_to_copy))
        return self._call(self._stub.CopyBlocks, request, self.call_timeout).num_copied

    def swap_blocks(
        self, blocks_to_swap_out: BlockPairs, blocks_to_swap_in: BlockPairs
    ) -> tuple[int, int]:
        """Swap ``(gpu, cpu)`` pairs out, then ``(cpu, gpu)`` pairs in; returns the counts."""
        request = pb.SwapBlocksRequest(
            blocks_to_swap_out=pairs_to_pb(blocks_to_swap_out),
            blocks_to_swap_in=pairs_to_pb(blocks_to_swap_in),
        )
        response = self._call(self._stub.SwapBlocks, request, self.call_timeout)
        return response.num_swapped_out, response.num_swapped_in

    def get_stats(self, timeout: float | None = None) -> ExecutorStats:
        request = pb.GetStatsRequest()
        response = self._call(self._stub.GetStats, request, timeout or self.call_timeout)
        return stats_from_pb(response)

    def health(self, timeout: float | None = None) -> str:
        """The executor's health status name: SERVING, NOT_SERVING, ...

        Raises ExecutorUnavailable when nothing answers.
        """
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        response = self._call(self._health.Check, request, timeout or self.call_timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING (model loaded, pools allocated).

        Raises ExecutorUnavailable when ``timeout`` seconds pass first.
        """
        deadline = time.monotonic() + timeout
        status = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                status = self.health(timeout=max(0.05, min(1.0, remaining)))
            except ExecutorUnavailable:
                status = "no answer"
            if status == "SERVING":
                return
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        raise ExecutorUnavailable(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{self.address} not SERVING after {timeout:.1f} s (last: {status})",
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
