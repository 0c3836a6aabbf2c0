"""Prometheus metrics of the scheduler, named as the README promises ("Observe"), summed
over the engines of every executor and refreshed after each step."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scheduler_svc.engine.engine import LLMEngine, StepOutcome
from scheduler_svc.engine.request_stats import RequestTracker, StepSummary

SLOT_UTILIZATION_PERIOD_S = 1.0  # its walk over every block table runs at most this often
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass(slots=True)
class EngineSample:
    """One engine's pools, queues and block-manager counters, read between its steps."""

    gpu_blocks: int
    gpu_used: int
    cpu_blocks: int
    cpu_used: int
    queues: dict[str, int]  # running / waiting / swapped -> groups
    slot_utilization: float
    slot_time: float  # when slot_utilization was computed
    prefix_queries: int
    prefix_hits: int
    cow_copies: int
    window_freed: int
    swapped_in: int
    swapped_out: int


def sample_engine(engine: LLMEngine, now: float, last: EngineSample | None) -> EngineSample:
    """Read an engine that is not stepping. Reuses the last slot utilization while the
    engine is busy and the last one is recent: computing it walks every table."""
    scheduler = engine.scheduler
    bm = scheduler.block_manager
    counters = bm.counters
    fresh = last is None or now - last.slot_time >= SLOT_UTILIZATION_PERIOD_S
    if fresh or not engine.has_unfinished():
        utilization, slot_time = bm.slot_utilization(), now
    else:
        utilization, slot_time = last.slot_utilization, last.slot_time
    return EngineSample(
        gpu_blocks=bm.gpu.num_blocks,
        gpu_used=bm.gpu.num_used_blocks,
        cpu_blocks=bm.cpu.num_blocks,
        cpu_used=bm.cpu.num_used_blocks,
        queues={
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "swapped": len(scheduler.swapped),
        },
        slot_utilization=utilization,
        slot_time=slot_time,
        prefix_queries=counters.prefix_cache_queries,
        prefix_hits=counters.prefix_cache_hits,
        cow_copies=counters.cow_copies,
        window_freed=counters.window_freed_blocks,
        swapped_in=counters.swapped_in_blocks,
        swapped_out=counters.swapped_out_blocks,
    )


class SchedulerMetrics:
    """A StepObserver: gauges summed over the latest sample of every engine, counters
    advanced by each engine's own deltas, request counters and histograms from the
    RequestTracker. Thread-safe: several engines may report from their own threads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tracker = RequestTracker()
        self._samples: dict[str, EngineSample] = {}
        self._config_labels: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._define_pool_metrics()
        self._define_request_metrics()

    def _define_pool_metrics(self) -> None:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"pagedserve_{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pagedserve_{name}", doc, labels, registry=self.registry)

        self.blocks_total = gauge("kv_blocks_total", "KV blocks in the pools", ("device",))
        self.blocks_used = gauge("kv_blocks_used", "KV blocks held by sequences", ("device",))
        self.usage = gauge("kv_cache_usage_ratio", "KV blocks held / total", ("device",))
        self.slot_utilization = gauge(
            "kv_slot_utilization_ratio", "filled token slots / slots of the held gpu blocks"
        )
        self.num_requests = gauge("num_requests", "requests by scheduler queue", ("state",))
        self.token_seconds = gauge(
            "token_seconds",
            "seconds a step took per token, lately (running mean) and the fastest seen; "
            "newcomers wait past --max-token-slowdown times the fastest",
            ("executor", "kind"),
        )
        self.config_info = gauge(
            "cache_config_info",
            "cache configuration of each executor's engine (value 1)",
            (
                "executor",
                "block_size",
                "num_gpu_blocks",
                "num_cpu_blocks",
                "enable_prefix_caching",
                "preemption_mode",
            ),
        )
        self.preemptions = counter("preemptions", "sequence groups preempted", ("mode",))
        self.prefix_queries = counter(
            "prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens found already computed")
        self.cow_copies = counter("cow_copies", "copy-on-write block copies")
        self.window_freed = counter(
            "kv_blocks_freed_outside_window",
            "blocks returned to the pool once wholly before a sliding window",
        )
        self.swapped_blocks = counter(
            "swapped_blocks", "blocks moved between the pools", ("direction",)
        )
        for mode in ("recompute", "swap"):  # every series exists from the first scrape
            self.preemptions.labels(mode)

    def _define_request_metrics(self) -> None:
        r = self.registry
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "tokens sent on request streams", registry=r
        )
        self.requests = Counter(
            "pagedserve_requests", "finished requests", ["finish_reason"], registry=r
        )
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        self.refused = Counter(
            "pagedserve_requests_refused", "requests refused at admission", ["reason"], registry=r
        )
        for reason in ("queue_full", "queue_wait"):
            self.refused.labels(reason)
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "arrival to first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "mean time between decode steps, per request",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "arrival to finish",
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def count_refused(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def after_step(self, name: str, engine: LLMEngine, outcome: StepOutcome) -> None:
        """StepObserver hook: account the step's requests, then re-sample ``engine``."""
        self._count_requests(self.tracker.observe(outcome, time.time()))
        now = time.monotonic()
        for _, mode in outcome.preempted:
            self.preemptions.labels(mode.value).inc()
        with self._lock:
            last = self._samples.get(name)
            if last is None:
                self._describe(name, engine)
            sample = sample_engine(engine, now, last)
            pace = engine.scheduler.pace
            if pace.recent:  # measured: not before two calls in a row
                self.token_seconds.labels(name, "recent").set(pace.recent)
                self.token_seconds.labels(name, "fastest").set(pace.fastest)
            self._advance_counters(sample, last)
            self._samples[name] = sample
            self._set_gauges()

    def forget(self, name: str) -> None:
        with self._lock:
            if self._samples.pop(name, None) is not None:
                self._set_gauges()
            for kind in ("recent", "fastest"):
                with contextlib.suppress(KeyError):  # never measured
                    self.token_seconds.remove(name, kind)
            labels = self._config_labels.pop(name, None)
            if labels is not None:
                self.config_info.remove(*labels)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def _count_requests(self, summary: StepSummary) -> None:
        self.generation_tokens.inc(summary.generation_tokens)
        for done in summary.finished:
            self.prompt_tokens.inc(done.prompt_tokens)
            self.requests.labels(done.finish_reason).inc()
            for histogram, value in ((self.ttft, done.ttft), (self.e2e, done.e2e)):
                if value is not None:
                    histogram.observe(value)
            if done.tpot is not None:
                self.tpot.observe(done.tpot)

    def _describe(self, name: str, engine: LLMEngine) -> None:
        bm = engine.scheduler.block_manager
        mode = engine.scheduler.config.preemption_mode
        labels = (
            name,
            str(bm.block_size),
            str(bm.gpu.num_blocks),
            str(bm.cpu.num_blocks),
            str(bm.enable_prefix_caching).lower(),
            mode.value if mode is not None else "auto",
        )
        self._config_labels[name] = labels
        self.config_info.labels(*labels).set(1)

    def _advance_counters(self, sample: EngineSample, last: EngineSample | None) -> None:
        """Counters move by this engine's growth since its last sample (a restarted
        engine starts again from zero, so a drop counts as a fresh start)."""

        def grow(counter: Counter, attr: str) -> None:
            now, before = getattr(sample, attr), getattr(last, attr) if last else 0
            counter.inc(now - before if now >= before else now)

        grow(self.prefix_queries, "prefix_queries")
        grow(self.prefix_hits, "prefix_hits")
        grow(self.cow_copies, "cow_copies")
        grow(self.window_freed, "window_freed")
        grow(self.swapped_blocks.labels("in"), "swapped_in")
        grow(self.swapped_blocks.labels("out"), "swapped_out")

    def _set_gauges(self) -> None:
        samples = list(self._samples.values())
        for device in ("gpu", "cpu"):
            total = sum(getattr(s, f"{device}_blocks") for s in samples)
            used = sum(getattr(s, f"{device}_used") for s in samples)
            self.blocks_total.labels(device).set(total)
            self.blocks_used.labels(device).set(used)
            self.usage.labels(device).set(used / total if total else 0.0)
        for state in ("running", "waiting", "swapped"):
            self.num_requests.labels(state).set(sum(s.queues[state] for s in samples))
        held = sum(s.gpu_used for s in samples)
        filled = sum(s.slot_utilization * s.gpu_used for s in samples)
        self.slot_utilization.set(filled / held if held else 1.0)
