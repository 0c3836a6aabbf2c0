"""Chunked prefill driven by the fake executor, which reads every context back through the
tables at each step: a chunk written to the wrong slots, or a prefix-cache hit on a block
no step has computed yet, fails there."""

from __future__ import annotations

import pytest

from pagedserve.settings import PreemptionMode
from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.sequence import SequenceGroup
from tests.scheduler_svc.fake_executor import EOS, FakeExecutor, run_engine, step
from tests.scheduler_svc.test_scheduler import add, assert_pools_full, make_scheduler


def run_mix(scheduler: Scheduler) -> tuple[list[SequenceGroup], list]:
    """Long and short prompts, samples and beams, finished by the fake executor."""
    groups = [
        add(scheduler, i, 3 + (i * 37) % 90, 6 + i % 7, n=1 + i % 3, ignore_eos=False)
        for i in range(16)
    ]
    groups.append(add(scheduler, 16, 70, 8, n=2, best_of=3, use_beam_search=True, temperature=0))
    executor = FakeExecutor(scheduler.block_manager, eos_after={"r3": 4, "r8": 2})
    finished, outputs = run_engine(scheduler, executor)
    assert len(finished) == len(groups)
    assert_pools_full(scheduler)
    return groups, outputs


@pytest.mark.parametrize(
    ("num_gpu_blocks", "mode"),
    [(400, None), (60, PreemptionMode.RECOMPUTE), (60, PreemptionMode.SWAP)],
    ids=["roomy", "recompute", "swap"],
)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompts_in_chunks_draw_what_whole_prompts_draw(num_gpu_blocks, mode, prefix_caching):
    results = []
    for chunked in (False, True):
        scheduler = make_scheduler(
            num_gpu_blocks=num_gpu_blocks,
            mode=mode,
            prefix_caching=prefix_caching,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=16 if chunked else 256,
        )
        groups, outputs = run_mix(scheduler)
        results.append([[s.output_token_ids for s in g.seqs] for g in groups])
        if chunked and num_gpu_blocks == 400:  # no preemption: every step keeps the budget
            assert max(out.num_batched_tokens for out in outputs) == 16
        if num_gpu_blocks == 60:
            assert any(out.preempted for out in outputs)
    assert results[0] == results[1]


def test_decodes_go_first_and_a_long_prompt_takes_what_they_leave():
    scheduler = make_scheduler(num_gpu_blocks=200, max_num_batched_tokens=16, num_decode_steps=1)
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    streams = [add(scheduler, i, 4, 40) for i in range(3)]
    step(scheduler, processor, executor)
    long_prompt = add(scheduler, 3, 50, 4)
    for index in range(4):  # 50 tokens at 13 a step beside three decodes: 13, 13, 13, 11
        out, _ = step(scheduler, processor, executor)
        assert [s.group for s in out.scheduled] == [*streams, long_prompt]
        assert [s.is_prefill for s in out.scheduled] == [False, False, False, True]
        assert out.num_batched_tokens == 3 + min(13, 50 - 13 * index)
        assert len(long_prompt.seqs[0].output_token_ids) == (index == 3)
    assert [len(s.seqs[0].output_token_ids) for s in streams] == [5, 5, 5]
    run_engine(scheduler, executor)
    assert_pools_full(scheduler)


def test_a_prompt_part_way_through_its_chunks_is_recomputed_not_swapped():
    """Three decoding streams leave one token a step to a 40-token prompt and grow until
    the pool is full, while the prompt is still part-way through."""
    scheduler = make_scheduler(
        num_gpu_blocks=20, max_num_batched_tokens=4, mode=PreemptionMode.SWAP, num_decode_steps=1
    )
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    streams = [add(scheduler, i, 4, 40) for i in range(3)]
    step(scheduler, processor, executor)
    prompt = add(scheduler, 3, 40, 4)
    preempted = []
    while not preempted:
        computed = prompt.seqs[0].num_computed_tokens
        preempted = step(scheduler, processor, executor)[0].preempted
    assert preempted == [(prompt, PreemptionMode.RECOMPUTE)]
    assert 0 < computed < 40
    run_engine(scheduler, executor)
    assert all(len(g.seqs[0].output_token_ids) == 40 for g in streams)
    assert len(prompt.seqs[0].output_token_ids) == 4
    assert_pools_full(scheduler)


def test_a_group_of_several_sequences_waiting_to_be_recomputed_is_not_starved():
    """Recomputed whole (its sequences differ), it may exceed the budget when it is the
    step's only prompt."""
    scheduler = make_scheduler(
        num_gpu_blocks=30, max_num_batched_tokens=8, mode=PreemptionMode.RECOMPUTE
    )
    groups = [add(scheduler, i, 10, 20, n=3) for i in range(3)]
    _, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    assert any(out.preempted for out in outputs)
    assert max(out.num_batched_tokens for out in outputs) > 8
    assert all(len(s.output_token_ids) == 20 for g in groups for s in g.seqs)
    assert_pools_full(scheduler)


def test_a_prompt_sharing_a_prefix_with_one_in_chunks_reuses_its_computed_blocks():
    scheduler = make_scheduler(
        num_gpu_blocks=100, max_num_batched_tokens=12, prefix_caching=True, num_decode_steps=1
    )
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    first = add(scheduler, 0, 40, 4)
    out, _ = step(scheduler, processor, executor)  # 12 of 40 tokens: 3 blocks computed
    twin = add(scheduler, 1, 40, 4)
    twin.seqs[0].prompt_token_ids = list(first.seqs[0].prompt_token_ids)
    cached = []
    while not twin.is_finished():
        out, _ = step(scheduler, processor, executor)
        cached += [s.num_cached_tokens for s in out.scheduled if s.group is twin and s.is_prefill]
    assert cached[0] == 36  # admitted once the first's last chunk ran: all but the last block
    assert first.seqs[0].output_token_ids == twin.seqs[0].output_token_ids
    run_engine(scheduler, executor)
    assert_pools_full(scheduler)
