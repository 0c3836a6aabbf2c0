"""Prometheus metrics of one executor process, served on their own port: pool sizes, step
times, forward tokens, swap and copy volumes."""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pagedserve.model_info import ModelInfo
from pagedserve.step import BlockPairs, ExecuteStep, StepResult

log = structlog.get_logger("executor_svc.metrics")

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)


class ExecutorMetrics:
    """Advanced by the server after each applied operation (replays count once, as steps
    replayed): a step's on the event loop while the next one runs, the others on the
    executor's thread (prometheus_client's metrics take either)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.pool_blocks = Gauge(
            "pagedserve_executor_kv_blocks_total", "blocks in each pool", ["device"], registry=r
        )
        self.step_seconds = Histogram(
            "pagedserve_executor_step_seconds",
            "one Execute: cache operations, then a forward pass and sampling per decode step",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.forward_tokens = Counter(
            "pagedserve_executor_forward_tokens", "tokens through the forward pass", registry=r
        )
        self.forward_seqs = Counter(
            "pagedserve_executor_forward_seqs", "sequences in the forward passes", registry=r
        )
        self.steps_ended_early = Counter(
            "pagedserve_executor_steps_ended_early",
            "calls of decode steps in a row cut short because a request arrived (EndSteps)",
            registry=r,
        )
        self.overhead_seconds = Counter(
            "pagedserve_executor_step_overhead_seconds",
            "time on the executor's thread around steps but outside them (judging a call, "
            "filling in its followers, recording it): what the next forward pass waits for",
            registry=r,
        )
        self.read_seconds = Counter(
            "pagedserve_executor_step_read_seconds",
            "time reading the Execute calls applied (parsing, checking), while the step "
            "before runs",
            registry=r,
        )
        self.replayed_steps = Counter(
            "pagedserve_executor_replayed_steps", "steps answered from the ledger", registry=r
        )
        self.swapped_blocks = Counter(
            "pagedserve_executor_swapped_blocks",
            "blocks copied between the pools",
            ["direction"],
            registry=r,
        )
        self.copied_blocks = Counter(
            "pagedserve_executor_copied_blocks", "copy-on-write block copies", registry=r
        )
        for device in ("gpu", "cpu"):
            self.pool_blocks.labels(device).set(0)
        for direction in ("in", "out"):
            self.swapped_blocks.labels(direction)

    def set_pools(self, info: ModelInfo) -> None:
        self.pool_blocks.labels("gpu").set(info.num_gpu_blocks)
        self.pool_blocks.labels("cpu").set(info.num_cpu_blocks)

    def observe_step(self, step: ExecuteStep, result: StepResult, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        # Decode steps each sequence ran: fewer than asked when the call ended early.
        runs = [
            len(o.token_ids) if s.num_steps > 1 else 1
            for s, o in zip(step.seqs, result.outputs, strict=True)
        ]
        self.forward_tokens.inc(
            sum(len(s.new_token_ids) + run - 1 for s, run in zip(step.seqs, runs, strict=True))
        )
        self.forward_seqs.inc(sum(runs))
        if any(run < s.num_steps for s, run in zip(step.seqs, runs, strict=True)):
            self.steps_ended_early.inc()
        self.observe_cache_ops(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)

    def observe_overhead(self, overhead_s: float, read_s: float) -> None:
        """A step's own time around it on the executor's thread, and reading its call."""
        self.overhead_seconds.inc(overhead_s)
        self.read_seconds.inc(read_s)

    def observe_cache_ops(
        self, swap_out: BlockPairs, swap_in: BlockPairs, copies: BlockPairs | None = None
    ) -> None:
        """Swaps and copies, in a step or from SwapBlocks / CopyBlocks."""
        self.swapped_blocks.labels("out").inc(len(swap_out))
        self.swapped_blocks.labels("in").inc(len(swap_in))
        self.copied_blocks.inc(len(copies or ()))

    def serve(self, host: str, port: int) -> bool:
        """Serve /metrics on ``host:port`` from a daemon thread; 0 disables. A taken port
        is logged, not fatal: metrics must never keep the executor from serving."""
        if port == 0:
            return False
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            log.warning("executor.metrics_unavailable", port=port, error=str(e))
            return False
        log.info("executor.metrics_listening", address=f"{host}:{port}")
        return True
