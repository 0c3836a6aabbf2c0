"""Admission under overload keeps the running streams' pace: a real LLMEngine stepping an
executor whose step takes longer the more sequences it holds, as a loaded one does."""

from __future__ import annotations

import time

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import PACING_BACKLOG, CacheConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqOutput, StepResult
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine.engine import LLMEngine

SECONDS_PER_SEQ = 0.005


class LoadedExecutor:
    """Sleeps SECONDS_PER_SEQ for each sequence of a step, draws token 7, and keeps the
    size of every step's batch with the number of requests left waiting."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.scheduler: Scheduler | None = None

    def execute(self, step: ExecuteStep) -> StepResult:
        assert self.scheduler is not None
        self.batches.append((len(step.seqs), len(self.scheduler.waiting)))
        time.sleep(SECONDS_PER_SEQ * len(step.seqs) * max(s.num_steps for s in step.seqs))
        outputs = [SeqOutput(s.seq_id, [7] * s.num_steps, [-0.1] * s.num_steps) for s in step.seqs]
        return StepResult(step.step_id, outputs)


def run_overloaded(max_token_slowdown: float, num_requests: int) -> list[tuple[int, int]]:
    """One stream alone for a while, then ``num_requests`` at once; returns each step's
    batch size and the requests left waiting."""
    executor = LoadedExecutor()
    cache = CacheConfig(block_size=8, num_gpu_blocks=512, num_cpu_blocks=0, watermark=0.0)
    sched = SchedulerConfig(
        max_model_len=256,
        max_num_batched_tokens=128,  # six newcomers' prompts a step at most
        num_decode_steps=1,
        max_token_slowdown=max_token_slowdown,
    )
    engine = LLMEngine(executor, cache, sched, eos_token_id=None)
    executor.scheduler = engine.scheduler
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("alone", [5] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    for i in range(num_requests):
        engine.add_request(f"r{i}", [100 + i] * 20, params)
    finished: list[str] = []
    while engine.has_unfinished():
        finished += [g.request_id for g in engine.step().finished]
    assert sorted(finished) == sorted(["alone"] + [f"r{i}" for i in range(num_requests)])
    return executor.batches


@pytest.mark.parametrize(
    ("slowdown", "num_requests"), [(0.0, 40), (3.0, 40), (3.0, PACING_BACKLOG - 1)]
)
def test_a_backlog_goes_in_only_while_a_token_takes_less_than_three_times_the_fastest(
    slowdown, num_requests
):
    steps = run_overloaded(slowdown, num_requests)
    batches = [batch for batch, _ in steps]
    if slowdown and num_requests >= PACING_BACKLOG:
        # While PACING_BACKLOG wait: ~3 sequences take three times one's time; 6 join at most.
        # Then the rest goes in as it fits.
        backlogged = [batch for batch, waiting in steps if waiting >= PACING_BACKLOG]
        assert len(backlogged) > 20 and max(backlogged) <= 12, steps
    else:  # no limit, or no backlog: in as fast as the token budget lets them
        assert max(batches) == num_requests + 1, batches
        assert batches.index(num_requests + 1) <= 14, batches  # 6 a step from the 7th
