"""Prometheus metrics of the scheduler, named as in DESIGN.md, refreshed after each step."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from scheduler_svc.engine import LLMEngine


class SchedulerMetrics:
    """Gauges read from the engine after a step; counters advanced by the deltas of its stats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.blocks_total = Gauge(
            "pagedserve_kv_blocks_total", "KV blocks in the pool", ["device"], registry=r
        )
        self.blocks_used = Gauge(
            "pagedserve_kv_blocks_used", "KV blocks held", ["device"], registry=r
        )
        self.usage = Gauge(
            "pagedserve_kv_cache_usage_ratio", "KV blocks held / total", ["device"], registry=r
        )
        self.num_requests = Gauge(
            "pagedserve_num_requests", "requests by scheduler queue", ["state"], registry=r
        )
        self.preemptions = Counter(
            "pagedserve_preemptions_total", "groups preempted", ["mode"], registry=r
        )
        self.prefix_queries = Counter(
            "pagedserve_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "pagedserve_prefix_cache_hits", "prompt tokens found computed", registry=r
        )
        self._preempted: dict[str, int] = {}
        self._prefix = (0, 0)

    def update(self, engine: LLMEngine) -> None:
        scheduler = engine.scheduler
        for pool in (scheduler.block_manager.gpu, scheduler.block_manager.cpu):
            self.blocks_total.labels(pool.device).set(pool.num_blocks)
            self.blocks_used.labels(pool.device).set(pool.num_used_blocks)
            self.usage.labels(pool.device).set(pool.num_used_blocks / max(pool.num_blocks, 1))
        for state, queue in (
            ("running", scheduler.running),
            ("waiting", scheduler.waiting),
            ("swapped", scheduler.swapped),
        ):
            self.num_requests.labels(state).set(len(queue))
        counters = scheduler.block_manager.counters
        queries, hits = counters.prefix_cache_queries, counters.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix[0])
        self.prefix_hits.inc(hits - self._prefix[1])
        self._prefix = (queries, hits)
        for mode, count in engine.stats.preemptions.items():
            self.preemptions.labels(mode).inc(count - self._preempted.get(mode, 0))
            self._preempted[mode] = count

    def render(self) -> str:
        return generate_latest(self.registry).decode()
