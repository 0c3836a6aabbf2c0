"""Scheduler scenarios driven by the fake executor: bursts, preemption, FCFS, rejection."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import PACING_BACKLOG, PreemptionMode, SchedulerConfig
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.output_processor import OutputProcessor
from scheduler_svc.core.scheduler import RequestRejectedError, Scheduler
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.scheduler_svc.fake_executor import EOS, FakeExecutor, run_engine, step


def make_scheduler(
    num_gpu_blocks: int = 16,
    num_cpu_blocks: int = 64,
    block_size: int = 4,
    mode: PreemptionMode | None = None,
    prefix_caching: bool = False,
    clock: Callable[[], float] = time.monotonic,
    **config,
) -> Scheduler:
    bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, 0.0, prefix_caching)
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_batched_tokens", 256)
    return Scheduler(SchedulerConfig(preemption_mode=mode, **config), bm, clock)


def add(
    scheduler: Scheduler, index: int, prompt_len: int, max_tokens: int, **params
) -> SequenceGroup:
    prompt = [100 + (index * 7 + i) % 50 for i in range(prompt_len)]
    params.setdefault("ignore_eos", True)
    group = SequenceGroup(
        f"r{index}",
        [Sequence(index, prompt)],
        arrival_time=float(index),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
    )
    scheduler.add_seq_group(group)
    return group


def assert_pools_full(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    bm.check_integrity()
    assert bm.block_tables == {}
    assert bm.gpu.num_free_blocks == bm.gpu.num_blocks
    assert bm.cpu.num_free_blocks == bm.cpu.num_blocks


@pytest.mark.parametrize("mode", [None, PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_burst_far_larger_than_the_pool_completes_with_preemptions(mode):
    scheduler = make_scheduler(num_gpu_blocks=40, mode=mode)
    groups = [add(scheduler, i, 5 + i % 9, 12 + (i * 5) % 13, n=1 + i % 3) for i in range(30)]
    finished, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    preempted = [mode for out in outputs for _, mode in out.preempted]
    assert preempted, "a pool of 40 blocks must preempt for 30 requests"
    if mode is not None:
        assert set(preempted) == {mode}
    else:  # the paper's default: recompute single sequences, swap groups
        assert set(preempted) == {PreemptionMode.RECOMPUTE, PreemptionMode.SWAP}
    assert sorted(g.request_id for g in finished) == sorted(g.request_id for g in groups)
    for group in groups:
        params = group.sampling_params
        assert len(group.seqs) == params.n
        assert all(len(s.output_token_ids) == params.max_tokens for s in group.seqs)
        assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in group.seqs)
    assert_pools_full(scheduler)


def test_preempted_output_equals_unpreempted_output():
    roomy, tight = make_scheduler(num_gpu_blocks=256), make_scheduler(num_gpu_blocks=20)
    results, num_preempted = [], []
    for scheduler in (roomy, tight):
        groups = [add(scheduler, i, 6 + i, 24, n=2) for i in range(8)]
        run_engine(scheduler, FakeExecutor(scheduler.block_manager))
        results.append([[s.output_token_ids for s in g.seqs] for g in groups])
        num_preempted.append(sum(g.num_preemptions for g in groups))
    assert num_preempted[0] == 0 and num_preempted[1] > 0
    assert results[0] == results[1]


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    scheduler = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=2, mode=PreemptionMode.SWAP)
    for i in range(6):
        add(scheduler, i, 8, 16)
    _, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    modes = {mode for out in outputs for _, mode in out.preempted}
    assert PreemptionMode.RECOMPUTE in modes
    assert_pools_full(scheduler)


def test_equal_requests_finish_in_arrival_order():
    scheduler = make_scheduler(num_gpu_blocks=10)
    for i in range(12):
        add(scheduler, i, 6, 12)
    finished, _ = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    assert [g.request_id for g in finished] == [f"r{i}" for i in range(12)]


def test_priority_goes_first_and_is_preempted_last():
    """Lower priority values run first, FCFS within a priority; under pressure the running
    group of the highest value (then the latest arrival) is the one preempted."""
    scheduler = make_scheduler(num_gpu_blocks=10, mode=PreemptionMode.RECOMPUTE)
    priorities = [5, 5, 0, 5, -1, 0]
    groups = [add(scheduler, i, 6, 12, priority=p) for i, p in enumerate(priorities)]
    finished, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    assert [g.request_id for g in finished] == ["r4", "r2", "r5", "r0", "r1", "r3"]
    victims = {g.request_id for out in outputs for g, _ in out.preempted}
    assert victims and not victims & {"r4", "r2"}  # the two first in order are never evicted
    assert_pools_full(scheduler)
    assert all(len(g.seqs[0].output_token_ids) == 12 for g in groups)


def test_no_starvation_long_request_amid_a_stream_of_short_ones():
    scheduler = make_scheduler(num_gpu_blocks=24)
    long_group = add(scheduler, 0, 30, 40)
    processor = OutputProcessor(scheduler, EOS)
    executor = FakeExecutor(scheduler.block_manager)
    steps, finished = 0, []
    while not long_group.is_finished():  # short requests keep arriving behind it
        add(scheduler, steps + 1, 4, 4)
        finished += step(scheduler, processor, executor)[1]
        steps += 1
    assert steps == 40 and long_group.num_preemptions == 0  # FCFS: the oldest is never evicted
    finished += run_engine(scheduler, executor)[0]
    assert sorted(g.request_id for g in finished) == sorted(f"r{i}" for i in range(steps + 1))
    assert_pools_full(scheduler)


def test_admission_respects_max_num_seqs_and_the_token_budget():
    scheduler = make_scheduler(
        num_gpu_blocks=200, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    for i in range(10):
        add(scheduler, i, 20, 8)
    _, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    for out in outputs:
        assert out.num_batched_tokens <= 64
        assert sum(len(s.group.get_seqs()) for s in out.scheduled) <= 4


def _paced_scheduler(num_waiting: int) -> tuple[Scheduler, OutputProcessor, FakeExecutor]:
    """One group running, ``num_waiting`` queued behind it, max_token_slowdown 4."""
    scheduler = make_scheduler(num_gpu_blocks=400, max_token_slowdown=4.0, num_decode_steps=1)
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    add(scheduler, 0, 6, 4)
    step(scheduler, processor, executor)
    for i in range(num_waiting):
        add(scheduler, 1 + i, 6, 4)
    return scheduler, processor, executor


def test_a_backlog_waits_while_the_running_streams_are_past_their_pace():
    """With max_token_slowdown 4 and PACING_BACKLOG requests waiting, none goes in while tokens
    have lately taken more than four times the fastest, one a step past twice; with
    nothing running, all that fit."""
    scheduler, processor, executor = _paced_scheduler(PACING_BACKLOG + 1)
    scheduler.pace.observe(0.010)  # the fastest: 10 ms a token
    for _ in range(8):
        scheduler.pace.observe(0.050)  # lately about 50: past four times
    assert scheduler.pace.recent > 0.040
    out, _ = step(scheduler, processor, executor)
    assert [s.group.request_id for s in out.scheduled] == ["r0"]
    for _ in range(4):
        scheduler.pace.observe(0.025)  # past twice, within four times: one a step
    assert 0.020 < scheduler.pace.recent < 0.040
    out, _ = step(scheduler, processor, executor)
    assert [s.group.request_id for s in out.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == PACING_BACKLOG
    for _ in range(16):
        scheduler.pace.observe(0.050)
    while scheduler.running:  # r0 and r1 end; the backlog stays out
        step(scheduler, processor, executor)
    assert len(scheduler.waiting) == PACING_BACKLOG
    out, _ = step(scheduler, processor, executor)  # nothing runs: all that fit
    assert len(out.scheduled) == PACING_BACKLOG and not scheduler.waiting


def test_a_short_queue_goes_in_past_the_pace_limit():
    """Short of PACING_BACKLOG waiting, arrivals do not outpace the executor by far: holding
    them back would only trade their first token's wait for the others' pace."""
    scheduler, processor, executor = _paced_scheduler(PACING_BACKLOG - 1)
    scheduler.pace.observe(0.010)
    for _ in range(8):
        scheduler.pace.observe(0.050)
    out, _ = step(scheduler, processor, executor)
    assert len(out.scheduled) == PACING_BACKLOG and not scheduler.waiting


def test_requests_that_can_never_fit_are_rejected_at_once():
    scheduler = make_scheduler(num_gpu_blocks=8)
    with pytest.raises(RequestRejectedError, match="maximum model length 256"):
        add(scheduler, 0, 250, 10)
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        add(scheduler, 1, 20, 20)  # 10 blocks of 4 tokens; the pool holds 8
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        add(scheduler, 2, 4, 8, n=4)  # four private tails do not fit
    assert not scheduler.has_unfinished()


def test_stop_token_ends_a_sequence_and_frees_its_blocks():
    scheduler = make_scheduler()
    group = add(scheduler, 0, 6, 50, ignore_eos=False)
    executor = FakeExecutor(scheduler.block_manager, eos_after={"r0": 5})
    run_engine(scheduler, executor)
    seq = group.seqs[0]
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_token_ids[-1] == EOS
    assert len(seq.output_token_ids) == 5
    assert_pools_full(scheduler)


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(num_gpu_blocks=14, num_decode_steps=1)  # r0 runs after 3 steps
    first = add(scheduler, 0, 8, 16, n=2)
    second = add(scheduler, 1, 8, 4)
    executor = FakeExecutor(scheduler.block_manager)
    processor = OutputProcessor(scheduler, EOS)
    for _ in range(3):
        step(scheduler, processor, executor)
    assert scheduler.abort("r0") is first
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in first.seqs)
    assert scheduler.abort("missing") is None
    run_engine(scheduler, executor)
    assert second.is_finished()
    assert_pools_full(scheduler)


def test_prefix_caching_skips_shared_prompt_blocks():
    scheduler = make_scheduler(num_gpu_blocks=64, prefix_caching=True)
    system = list(range(200, 216))  # four full blocks of 4
    groups = []
    for i in range(4):
        group = SequenceGroup(
            f"r{i}", [Sequence(i, [*system, 300 + i])], float(i), SamplingParams(max_tokens=6)
        )
        scheduler.add_seq_group(group)
        groups.append(group)
    _, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    cached = [s.num_cached_tokens for out in outputs for s in out.scheduled if s.is_prefill]
    assert cached == [0, 16, 16, 16]
    counters = scheduler.block_manager.counters
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (68, 48)


def test_beam_search_keeps_width_beams_and_returns_the_best():
    scheduler = make_scheduler(num_gpu_blocks=64)
    group = add(scheduler, 0, 7, 10, n=2, best_of=3, use_beam_search=True, temperature=0)
    _, outputs = run_engine(scheduler, FakeExecutor(scheduler.block_manager))
    assert len(group.seqs) == 3
    assert all(len(s.output_token_ids) == 10 for s in group.seqs)
    best = group.outputs()
    assert len(best) == 2 and best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert sum(len(out.blocks_to_copy) for out in outputs) > 0
    assert_pools_full(scheduler)


@pytest.mark.parametrize("num_gpu_blocks", [256, 40])  # roomy; tight: preemptions too
def test_decode_steps_in_a_row_draw_what_single_steps_draw(num_gpu_blocks):
    """The fake reads every context back through the tables at each step of a call, so a
    slot mapped ahead into a shared or missing block fails here."""
    results, calls = [], []
    for num_decode_steps in (1, 4):
        scheduler = make_scheduler(num_gpu_blocks=num_gpu_blocks, num_decode_steps=num_decode_steps)
        groups = [
            add(scheduler, i, 5 + i % 9, 12 + (i * 5) % 13, n=1 + i % 3, ignore_eos=False)
            for i in range(20)
        ]
        executor = FakeExecutor(scheduler.block_manager, eos_after={"r3": 6, "r7": 9})
        finished, _ = run_engine(scheduler, executor)
        assert len(finished) == len(groups)
        assert_pools_full(scheduler)
        results.append([[s.output_token_ids for s in g.seqs] for g in groups])
        calls.append(executor.steps)
    assert results[0] == results[1]
    assert calls[1] < calls[0]


@pytest.mark.parametrize("num_decode_steps", [1, 4])
@pytest.mark.parametrize("num_gpu_blocks,num_requests", [(256, 4), (40, 20)])  # tight: preempts
def test_a_call_applied_whole_equals_a_call_applied_step_by_step(
    num_decode_steps, num_gpu_blocks, num_requests
):
    """OutputProcessor.process_run against process, with stops by EOS (inside a run of
    decode steps too) and by length, and prompt chunks along the way."""
    results = []
    for whole_runs in (False, True):
        scheduler = make_scheduler(
            num_gpu_blocks=num_gpu_blocks,
            num_decode_steps=num_decode_steps,
            max_num_batched_tokens=8,
            enable_chunked_prefill=True,
        )
        groups = [
            add(scheduler, i, 5 + i % 9, 12 + (i * 5) % 13, ignore_eos=False)
            for i in range(num_requests)
        ]
        eos_after = {"r1": 7, "r2": 4, "r3": 6, "r7": 9}
        executor = FakeExecutor(scheduler.block_manager, eos_after=eos_after)
        finished, _ = run_engine(scheduler, executor, whole_runs=whole_runs)
        assert sorted(g.request_id for g in finished) == sorted(g.request_id for g in groups)
        assert_pools_full(scheduler)
        seqs = [s for g in groups for s in g.seqs]
        results.append([(s.output_token_ids, s.output_logprobs, s.status) for s in seqs])
        assert [len(g.seqs[0].output_token_ids) for g in groups[1:3]] == [7, 4]  # EOS included
    assert results[0] == results[1]


def test_decode_steps_run_in_a_row_only_for_decodes_with_nothing_waiting():
    scheduler = make_scheduler(num_gpu_blocks=64, num_decode_steps=4)
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    first = add(scheduler, 0, 6, 10)
    step(scheduler, processor, executor)  # prefill: one token
    assert len(first.seqs[0].output_token_ids) == 1
    step(scheduler, processor, executor)  # decodes only, nothing waits: four in a row
    assert len(first.seqs[0].output_token_ids) == 5
    second = add(scheduler, 1, 6, 10)
    out, _ = step(scheduler, processor, executor)  # the newcomer's prefill joins: one step
    assert len(out.scheduled) == 2 and len(first.seqs[0].output_token_ids) == 6
    step(scheduler, processor, executor)  # in a row again, each up to its max_tokens
    assert [len(g.seqs[0].output_token_ids) for g in (first, second)] == [10, 5]
    assert first.is_finished()
    add(scheduler, 2, 6, 8, n=2, use_beam_search=True, temperature=0)
    step(scheduler, processor, executor)
    step(scheduler, processor, executor)  # beams are chosen between steps: one step
    assert len(second.seqs[0].output_token_ids) == 7


def test_decode_steps_run_in_a_row_only_after_a_quiet_spell_without_arrivals():
    now = [100.0]
    scheduler = make_scheduler(
        num_gpu_blocks=64, num_decode_steps=4, decode_steps_quiet_s=2.0, clock=lambda: now[0]
    )
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    first = add(scheduler, 0, 6, 20)
    for now[0], total in ((100.0, 1), (101.9, 2), (102.0, 6)):  # prefill; 1.9 s; 2 s quiet
        step(scheduler, processor, executor)
        assert len(first.seqs[0].output_token_ids) == total
    second = add(scheduler, 1, 6, 20)  # arrives at 102: one step a call until 104
    for now[0], totals in ((102.0, (7, 1)), (103.5, (8, 2)), (104.0, (12, 6))):
        step(scheduler, processor, executor)
        assert tuple(len(g.seqs[0].output_token_ids) for g in (first, second)) == totals


@pytest.mark.parametrize(
    ("span_s", "seconds_per_token", "in_a_row"),
    [(0.1, 0.03, 3), (0.1, 0.005, 8), (0.1, 0.2, 1), (0.0, 0.2, 8)],
)
def test_decode_steps_in_a_row_last_no_longer_than_their_span_at_the_recent_pace(
    span_s: float, seconds_per_token: float, in_a_row: int
):
    """Their tokens reach the streams together when the call ends: where steps are slow,
    fewer run in a row (0: no bound)."""
    scheduler = make_scheduler(num_gpu_blocks=64, num_decode_steps=8, decode_steps_span_s=span_s)
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    group = add(scheduler, 0, 6, 40)
    step(scheduler, processor, executor)  # the prefill
    scheduler.pace.observe(seconds_per_token)  # as the engine reports each step
    step(scheduler, processor, executor)
    assert len(group.seqs[0].output_token_ids) == 1 + in_a_row


def test_decode_steps_run_in_a_row_only_when_the_pool_has_their_blocks():
    scheduler = make_scheduler(num_gpu_blocks=8, num_decode_steps=8)  # blocks of 4 tokens
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    long, short = add(scheduler, 0, 11, 13), add(scheduler, 1, 15, 2)
    step(scheduler, processor, executor)  # 3 + 4 blocks taken, 1 free
    step(scheduler, processor, executor)  # 8 in a row would need 2 more for `long`
    assert [len(g.seqs[0].output_token_ids) for g in (long, short)] == [2, 2]
    assert short.is_finished()
    step(scheduler, processor, executor)  # `short` gave its blocks back
    assert len(long.seqs[0].output_token_ids) == 10
    step(scheduler, processor, executor)
    assert long.is_finished() and len(long.seqs[0].output_token_ids) == 13
    assert_pools_full(scheduler)


def _in_flight(scheduler: Scheduler, out) -> dict[int, int]:
    """What a call draws: each sampled sequence's decode steps (as the engine reads them
    off its ExecuteStep)."""
    bm = scheduler.block_manager
    return {
        seq.seq_id: bm.num_slots(seq) - seq.get_len() + 1
        for s in out.scheduled
        for seq in s.group.get_seqs(SequenceStatus.RUNNING)
    }


@pytest.mark.parametrize("newcomer", [False, True], ids=["alone", "with-a-newcomer"])
def test_the_call_ahead_maps_each_sequence_past_the_call_in_flight(newcomer: bool):
    """Sent before the call in flight answers, the next call maps each sequence's slots
    as if that call drew all its tokens, leaves out what ends by length within it, and
    admits a newcomer behind them; the tables stay whole. With a newcomer it is one step
    (the newcomer's first token would otherwise wait for all the steps in a row)."""
    scheduler = make_scheduler(num_gpu_blocks=64, num_decode_steps=4)
    bm = scheduler.block_manager
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(bm)
    long, short = add(scheduler, 0, 6, 20), add(scheduler, 1, 6, 3)
    step(scheduler, processor, executor)  # prefills: one token each
    out = scheduler.schedule()  # decodes: 4 in a row for `long`, 2 for `short` (max_tokens)
    assert [s.group for s in out.scheduled] == [long, short]
    drawing = _in_flight(scheduler, out)
    assert drawing == {0: 4, 1: 2}
    waiting = [add(scheduler, 2, 5, 10)] if newcomer else []
    ahead = scheduler.schedule_ahead(drawing)
    assert [s.group for s in ahead.scheduled] == [long, *waiting]
    # `long` maps its 4 tokens in flight and 4 more, or 1 with a newcomer; `short` ends
    # with the call in flight.
    assert bm.num_slots(long.seqs[0]) == long.seqs[0].get_len() + 4 + (1 if newcomer else 4) - 1
    if newcomer:
        assert ahead.scheduled[1].is_prefill and waiting[0].seqs[0].status == SequenceStatus.RUNNING
    bm.check_integrity()


def test_a_second_call_ahead_follows_the_first_and_counts_both_calls_in_flight():
    """With two calls unapplied (three on the wire), the next maps each sequence past
    the tokens both draw; one that ends by length within them is left out of the call
    followed and of the next, and one the call followed left out for another reason
    makes the next call wait."""
    scheduler = make_scheduler(num_gpu_blocks=64, num_decode_steps=1)
    bm = scheduler.block_manager
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(bm)
    long, short = add(scheduler, 0, 6, 20), add(scheduler, 1, 6, 3)
    step(scheduler, processor, executor)  # prefills: one token each
    first = _in_flight(scheduler, scheduler.schedule())  # `short` draws its second token
    second = scheduler.schedule_ahead(first)
    assert [s.group for s in second.scheduled] == [long, short]  # and its third
    drawing = {seq_id: 2 for seq_id in first}
    following = {long.seqs[0].seq_id, short.seqs[0].seq_id}
    third = scheduler.schedule_ahead(drawing, following)
    assert [s.group for s in third.scheduled] == [long]  # `short` ends with the second
    # Slots for its tokens and the two the calls in flight draw (the third feeds the last in).
    assert bm.num_slots(long.seqs[0]) == long.seqs[0].get_len() + 2
    # A sequence with tokens to go that the call followed left out: no call goes ahead.
    tables = {k: list(v) for k, v in bm.block_tables.items()}
    assert scheduler.schedule_ahead(drawing, {short.seqs[0].seq_id}) is None
    assert bm.block_tables == tables
    bm.check_integrity()


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"n": 2}, "may fork"),
        ({"use_beam_search": True, "n": 2, "temperature": 0}, "beams"),
        ({"presence_penalty": 0.5}, "needs its history"),
    ],
)
def test_no_call_goes_ahead_when_the_next_depends_on_the_answer(params, why):
    scheduler = make_scheduler(num_gpu_blocks=64, num_decode_steps=1)
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    add(scheduler, 0, 6, 20)
    add(scheduler, 1, 6, 20, **params)
    step(scheduler, processor, executor)
    out = scheduler.schedule()
    tables = {k: list(v) for k, v in scheduler.block_manager.block_tables.items()}
    assert scheduler.schedule_ahead(_in_flight(scheduler, out)) is None, why
    assert scheduler.block_manager.block_tables == tables  # nothing changed


def test_no_call_goes_ahead_for_a_prompt_chunk_or_without_blocks():
    scheduler = make_scheduler(num_gpu_blocks=64, max_num_batched_tokens=8)
    add(scheduler, 0, 20, 5)  # a prompt in chunks of 8 tokens: its first chunk draws nothing
    scheduler.schedule()
    assert scheduler.schedule_ahead({}) is None
    scheduler = make_scheduler(num_gpu_blocks=5, num_decode_steps=1)  # 4 tokens a block
    processor, executor = OutputProcessor(scheduler, EOS), FakeExecutor(scheduler.block_manager)
    groups = [add(scheduler, i, 7, 5) for i in range(2)]
    step(scheduler, processor, executor)  # 2 blocks each hold prompt and first token
    out = scheduler.schedule()  # position 7: still in the second block
    assert len(out.scheduled) == 2 and scheduler.block_manager.gpu.num_free_blocks == 1
    assert scheduler.schedule_ahead(_in_flight(scheduler, out)) is None  # position 8: 2 more
    assert [len(g.seqs[0].output_token_ids) for g in groups] == [1, 1]
