"""Scheduler metrics, request log lines and the block map, fed by a real LLMEngine stepping
a counting executor in process (tiny pools force preemptions)."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqOutput, StepResult
from scheduler_svc.api.dashboard import MAX_CELLS, Dashboard, pool_cells
from scheduler_svc.engine.engine import LLMEngine, StepOutcome
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.state.streams import RequestDelta


class CountingExecutor:
    """Draws token 7 + i for the i-th sample of every sequence (token 7 at each of its
    ``num_steps`` decode steps in a row); computes nothing."""

    def execute(self, step: ExecuteStep) -> StepResult:
        outputs = []
        for s in step.seqs:
            token_ids = [7 + i for i in range(s.num_samples)] * s.num_steps
            outputs.append(SeqOutput(s.seq_id, token_ids, [-0.1] * len(token_ids)))
        return StepResult(step.step_id, outputs)


def make_engine(num_gpu_blocks: int = 12, prefix_caching: bool = False) -> LLMEngine:
    cache = CacheConfig(
        block_size=8,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=64,
        watermark=0.0,
        enable_prefix_caching=prefix_caching,
    )
    # One token per step: the scenarios below count steps.
    sched = SchedulerConfig(max_model_len=256, max_num_batched_tokens=256, num_decode_steps=1)
    return LLMEngine(CountingExecutor(), cache, sched, eos_token_id=None)


def value(metrics: SchedulerMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(f"pagedserve_{name}", labels)
    assert found is not None, f"{name}{labels} missing"
    return found


def run(engine: LLMEngine, observers: list, name: str = "ex") -> dict[str, int]:
    """Step to the end like the engine loop; returns the tokens each "client" received."""
    received: dict[str, int] = {}
    while engine.has_unfinished():
        outcome = engine.step()
        for observer in observers:
            observer.after_step(name, engine, outcome)
        for delta in outcome.deltas:
            tokens = sum(len(out.token_ids) for out in delta.outputs)
            received[delta.request_id] = received.get(delta.request_id, 0) + tokens
        if isinstance(observers[0], SchedulerMetrics):
            for device in ("gpu", "cpu"):
                assert 0 <= value(observers[0], "kv_cache_usage_ratio", device=device) <= 1
            assert 0 <= value(observers[0], "kv_slot_utilization_ratio") <= 1
    return received


def test_counters_histograms_and_logs_under_preemption():
    engine, metrics = make_engine(), SchedulerMetrics()
    prompts = {f"r{i}": [100 + i] * (9 + i) for i in range(6)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        params = SamplingParams(max_tokens=20, ignore_eos=True, n=1 + i % 2, temperature=1.0)
        engine.add_request(request_id, prompt, params)
    with capture_logs() as logs:
        received = run(engine, [metrics])

    preempted = [e for e in logs if e["event"] == "request preempted"]
    finished = [e for e in logs if e["event"] == "request finished"]
    assert {e["log_level"] for e in logs} == {"info"} and len(logs) == len(preempted + finished)
    assert preempted and {e["mode"] for e in preempted} == {"recompute", "swap"}
    modes = {m: value(metrics, "preemptions_total", mode=m) for m in ("recompute", "swap")}
    assert sum(modes.values()) == len(preempted)
    assert sorted(e["request_id"] for e in finished) == sorted(prompts)
    for line in finished:
        rid = line["request_id"]
        assert line["finish_reason"] == "length"
        assert line["prompt_tokens"] == len(prompts[rid])
        assert line["generation_tokens"] == received[rid]
        assert line["num_preemptions"] == sum(e["request_id"] == rid for e in preempted)
        assert 0 <= line["ttft_s"] <= line["e2e_s"] and line["tpot_s"] >= 0

    assert value(metrics, "generation_tokens_total") == sum(received.values())
    assert value(metrics, "prompt_tokens_total") == sum(len(p) for p in prompts.values())
    assert value(metrics, "requests_total", finish_reason="length") == len(prompts)
    for histogram in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert value(metrics, f"{histogram}_count") == len(prompts)
    assert value(metrics, "kv_blocks_used", device="gpu") == 0
    assert value(metrics, "kv_blocks_used", device="cpu") == 0
    assert value(metrics, "kv_blocks_total", device="gpu") == 12
    assert value(metrics, "swapped_blocks_total", direction="out") > 0
    assert value(metrics, "swapped_blocks_total", direction="in") == value(
        metrics, "swapped_blocks_total", direction="out"
    )
    assert value(metrics, "num_requests", state="running") == 0
    assert metrics.tracker.num_live == 0
    info = {"executor": "ex", "block_size": "8", "num_gpu_blocks": "12", "num_cpu_blocks": "64"}
    info |= {"enable_prefix_caching": "false", "preemption_mode": "auto"}
    assert value(metrics, "cache_config_info", **info) == 1


def test_gauges_sum_over_executors_and_forget_one():
    metrics = SchedulerMetrics()
    big, small = make_engine(num_gpu_blocks=20), make_engine(num_gpu_blocks=12)
    big.add_request("a", [1] * 30, SamplingParams(max_tokens=4, ignore_eos=True))
    metrics.after_step("big", big, big.step())
    metrics.after_step("small", small, StepOutcome())
    assert value(metrics, "kv_blocks_total", device="gpu") == 32
    assert value(metrics, "kv_blocks_used", device="gpu") == 4  # 30 prompt tokens in blocks of 8
    assert value(metrics, "kv_cache_usage_ratio", device="gpu") == 4 / 32
    assert value(metrics, "kv_slot_utilization_ratio") == 30 / 32  # the prompt's slots
    assert "pagedserve_token_seconds{" not in metrics.render()  # no step after another yet
    metrics.after_step("big", big, big.step())
    fastest = value(metrics, "token_seconds", executor="big", kind="fastest")
    assert 0 < fastest == value(metrics, "token_seconds", executor="big", kind="recent")
    metrics.forget("big")
    assert value(metrics, "kv_blocks_total", device="gpu") == 12
    assert value(metrics, "kv_blocks_used", device="gpu") == 0
    assert 'executor="big"' not in metrics.render()


def test_an_abort_that_never_reached_outcome_finished_still_logs_one_line():
    """A lane that aborts a group only emits its final stream event: the tracker ends
    the request from that event, with the group it saw running."""
    engine, metrics = make_engine(), SchedulerMetrics()
    engine.add_request("gone", [5] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    with capture_logs() as logs:
        metrics.after_step("ex", engine, engine.step())
        group = engine.abort("gone")
        delta = engine.streams.delta(group, finished=True)
        metrics.after_step("ex", engine, StepOutcome(deltas=[delta]))
    (line,) = logs
    assert line["event"] == "request finished" and line["request_id"] == "gone"
    assert line["finish_reason"] == "abort" and line["generation_tokens"] == 1
    assert value(metrics, "requests_total", finish_reason="abort") == 1
    assert value(metrics, "kv_blocks_used", device="gpu") == 0


def test_unknown_request_aborted_before_running_has_no_latency():
    metrics = SchedulerMetrics()
    delta = RequestDelta("early", prompt_len=3, event=1, finished=True)
    with capture_logs() as logs:
        metrics.after_step("ex", make_engine(), StepOutcome(deltas=[delta]))
    assert logs[0]["request_id"] == "early" and logs[0]["e2e_s"] is None
    assert value(metrics, "e2e_request_latency_seconds_count") == 0


def test_block_map_matches_the_block_manager_exactly():
    engine = make_engine(num_gpu_blocks=16, prefix_caching=True)
    dashboard = Dashboard(capture_period_s=0)  # a snapshot after every step
    shared = [9] * 16  # two full blocks, shared through the prefix cache
    engine.add_request("a", [*shared, 1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", [*shared, 3], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    state = asyncio.run(dashboard.state())  # marks the map as watched
    for _ in range(2):  # b forked its two samples; both requests still run
        dashboard.after_step("ex", engine, engine.step())
    state = asyncio.run(dashboard.state())
    (ex,) = state["executors"]
    bm = engine.scheduler.block_manager
    gpu = ex["gpu"]
    assert gpu["blocks_per_cell"] == 1 and len(gpu["owner"]) == 16
    assert gpu["refs"] == bm.gpu.ref_counts
    owners = {ex["requests"][o] for o in gpu["owner"] if o >= 0}
    assert owners == {"a", "b"} and max(gpu["refs"]) >= 3  # a + b's two samples
    assert ex["used"]["gpu"] == sum(r > 0 for r in gpu["refs"])
    assert ex["queues"]["running"]["ids"] == ["a", "b"]
    while engine.has_unfinished():  # b finishes first; its private blocks stay cached
        dashboard.after_step("ex", engine, engine.step())
    (ex,) = asyncio.run(dashboard.state())["executors"]
    cached = set(bm.gpu.cached_block_ids())
    assert ex["gpu"]["cached_free"] == sorted(cached) and cached
    assert ex["used"]["gpu"] == 0 and ex["generation_tokens"] == 30 + 2 * 3


def test_large_pools_draw_several_blocks_per_cell():
    cells = pool_cells(40_000, [(0, [0, 1, 39_999])], cached=[5, 6])
    assert cells["blocks_per_cell"] == 3 and len(cells["owner"]) <= MAX_CELLS
    assert cells["owner"][0] == 0 and cells["refs"][0] == 2 and cells["refs"][-1] == 1
    assert cells["cached_free"] == [1, 2]


@pytest.mark.parametrize("watched", [False, True])
def test_an_unwatched_busy_engine_is_not_snapshotted(watched):
    engine, dashboard = make_engine(), Dashboard()
    engine.add_request("a", [1] * 10, SamplingParams(max_tokens=30, ignore_eos=True))
    if watched:
        asyncio.run(dashboard.state())
    dashboard.after_step("ex", engine, engine.step())
    assert (dashboard._engines["ex"].view is not None) == watched
