"""After every step the journal's stored groups read back equal to the live ones, whether
written whole or as deltas, on the real (tiny) model."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, PromptLogprob, StepResult
from scheduler_svc.engine.engine import LLMEngine, StepExecutor, StepOutcome
from scheduler_svc.state.journal import COMPACT_AFTER, MAX_DELTAS
from scheduler_svc.state.persistence import group_from_json
from scheduler_svc.state.state_store import InMemoryStateStore, StateStore, StepCommit
from scheduler_svc.state.streams import RequestDelta

REQUESTS = {
    "greedy": SamplingParams(temperature=0, max_tokens=COMPACT_AFTER + 8, ignore_eos=True),
    "samples": SamplingParams(n=2, temperature=0.9, seed=1, max_tokens=12, logprobs=2),
    "beams": SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=6),
    "stop": SamplingParams(temperature=0.9, seed=2, max_tokens=16, stop=("e",)),
    "scored": SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
}


class CountingStore(InMemoryStateStore):
    def __init__(self) -> None:
        super().__init__()
        self.whole: dict[str, int] = dict.fromkeys(REQUESTS, 0)
        self.appended: dict[str, int] = dict.fromkeys(REQUESTS, 0)

    def commit(self, commit: StepCommit) -> bool:
        for rid in commit.upsert_groups:
            self.whole[rid] += 1
        for rid in commit.append_groups:
            self.appended[rid] += 1
        return super().commit(commit)


def _live_groups(engine: LLMEngine) -> dict[str, tuple]:
    sched = engine.scheduler
    bm = sched.block_manager
    return {
        group.request_id: (
            group,
            {
                seq.seq_id: (list(bm.block_tables[seq.seq_id]), bm.num_slots(seq))
                for seq in group.seqs
                if seq.seq_id in bm.block_tables
            },
        )
        for group in sched.waiting + sched.running + sched.swapped
    }


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_stored_groups_equal_the_live_ones_after_every_step(
    journaled_engine: Callable[..., LLMEngine], num_decode_steps: int
) -> None:
    store = CountingStore()
    engine = journaled_engine(store, num_decode_steps)
    engine.recover()
    for i, (rid, params) in enumerate(REQUESTS.items()):
        engine.add_request(rid, [100 + i, 200, 300, 400, 500], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        engine.flush()  # the step's results, committed now rather than with the next step
        steps += 1
        live = _live_groups(engine)
        stored = store.load().groups
        assert stored.keys() == live.keys(), f"step {steps}"
        for rid, text in stored.items():
            restored = group_from_json(text)
            assert (restored.group, restored.block_tables) == live[rid], f"{rid} at step {steps}"
            assert_compacted(text)
    assert store.load().groups == {}
    assert store.appended["samples"] > 0
    assert store.whole["beams"] > 1  # beams fork and drop: written whole
    if num_decode_steps == 1:  # one append per token: the long request was compacted
        assert store.appended["greedy"] >= COMPACT_AFTER
        assert store.whole["greedy"] >= 2
    else:  # several tokens per step, each step's slots mapped ahead and stored
        assert steps < REQUESTS["greedy"].max_tokens
        assert store.appended["greedy"] > 0


def assert_compacted(text: str) -> int:
    """A stored group's deltas: written while fewer than COMPACT_AFTER, or smaller
    together than its whole write; never more than MAX_DELTAS. Returns their number."""
    whole, *deltas = text.split("\n")
    assert len(deltas) <= MAX_DELTAS
    assert len(deltas) <= COMPACT_AFTER or sum(map(len, deltas[:-1])) < len(whole)
    return len(deltas)


def test_a_long_group_is_written_whole_when_its_deltas_add_up_to_it(
    journaled_engine: Callable[..., LLMEngine],
) -> None:
    """A long prompt makes a whole write worth many deltas: the group takes more than
    COMPACT_AFTER of them before it is written whole again, and reads back equal."""
    store = InMemoryStateStore()
    engine = journaled_engine(store, 1)
    engine.recover()
    params = SamplingParams(temperature=0, max_tokens=4 * COMPACT_AFTER, ignore_eos=True)
    engine.add_request("long", list(range(100, 800)), params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        engine.flush()
        for rid, text in store.load().groups.items():
            assert group_from_json(text).group == _live_groups(engine)[rid][0]
            most = max(most, assert_compacted(text))
    assert COMPACT_AFTER < most < 4 * COMPACT_AFTER  # compacted once the deltas added up


class _WrittenStore(InMemoryStateStore):
    """Keeps the ids of the groups each commit writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[set[str]] = []

    def commit(self, commit: StepCommit) -> bool:
        self.written.append({*commit.upsert_groups, *commit.append_groups})
        return super().commit(commit)


def test_a_commit_of_some_groups_leaves_the_others_and_none_follows_a_table_change(
    journaled_engine: Callable[..., LLMEngine],
) -> None:
    """A commit may write some of the touched groups (a first token's, within the commit
    interval); the others wait, still touched, for the next. Not once a table that stays
    gave blocks back: its stored table would claim blocks another group may hold. Nor
    once a new table shares a block another holds (a prefix cache hit)."""
    store = _WrittenStore()
    engine = journaled_engine(store, 1)
    engine.recover()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for rid in ("x", "y"):
        engine.add_request(rid, [100, 200, 300], params)
    for _ in range(20):  # x's first block fills
        engine.step()
    engine.flush()
    journal, scheduler = engine.journal, engine.scheduler
    groups = {g.request_id: g for g in scheduler.running}
    meta = {"step_id": "3"}
    for group in groups.values():
        journal.touch(group)
    assert journal.can_write_some(scheduler)
    journal.commit(scheduler, meta, groups={"x"})
    journal.commit(scheduler, meta)
    assert store.written[-2:] == [{"x"}, {"y"}]
    # A request taken from the submission queue leaves it with its group written.
    submitted = engine.add_request("w", [100, 200], params)
    journal.touch(groups["x"])
    journal.commit(scheduler, meta, groups={"x"})
    assert store.written[-1] == {"x", "w"}
    assert "w" in store.load().groups
    scheduler.abort(submitted.request_id)
    journal.remove(submitted.request_id)
    journal.commit(scheduler, meta)

    bm = scheduler.block_manager
    (seq,) = groups["x"].seqs
    bm.append_slots(seq, lookahead=4 * bm.block_size)  # slots for steps in a row ...
    assert journal.can_write_some(scheduler)  # (a table that grew claims nothing of others)
    bm.unmap_ahead(seq)  # ... that did not run: their blocks go back
    assert not journal.can_write_some(scheduler)
    with pytest.raises(AssertionError):
        journal.commit(scheduler, meta, groups={"y"})
    journal.touch(groups["x"])
    journal.commit(scheduler, meta)
    assert store.written[-1] == {"x"} and journal.can_write_some(scheduler)

    prompt = [100, 200, 300, *seq.output_token_ids]  # x's tokens: its full block hits
    engine.add_request("z", prompt[: bm.block_size + 1], params)
    engine.scheduler.schedule()
    assert not journal.can_write_some(scheduler)


@pytest.mark.parametrize(("kill_after", "num_decode_steps"), [(3, 4), (COMPACT_AFTER + 3, 1)])
def test_a_new_leader_resumes_from_deltas(
    journaled_engine: Callable[..., LLMEngine], kill_after: int, num_decode_steps: int
) -> None:
    """Groups stored as a snapshot plus deltas restore into an engine that finishes them
    with the tokens of an uninterrupted run (greedy)."""
    params = SamplingParams(temperature=0, max_tokens=COMPACT_AFTER + 8, ignore_eos=True)
    prompts = {"a": [100, 200, 300], "b": [400, 500, 600, 700]}

    def run(store: StateStore, new: bool, steps: int = -1) -> dict[str, list[int]]:
        engine = journaled_engine(store, num_decode_steps)
        engine.recover()
        for rid, prompt in prompts.items() if new else ():
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished() and steps != 0:
            done |= {g.request_id: g.seqs[0].output_token_ids for g in engine.step().finished}
            steps -= 1
        return done

    reference = run(InMemoryStateStore(), new=True)
    store = InMemoryStateStore()
    assert run(store, new=True, steps=kill_after) == {}
    assert any("\n" in text for text in store.load().groups.values())
    assert run(store, new=False) == reference


@pytest.mark.parametrize("kv_lost", [False, True], ids=["replayed", "recomputed"])
@pytest.mark.parametrize("kill_after", [1, 2, 3, 4])
def test_prompt_logprobs_survive_a_new_leader(
    journaled_engine: Callable[..., LLMEngine], store: StateStore, kill_after: int, kv_lost: bool
) -> None:
    """A prompt scored in three chunks, its leader gone after any step: the step in flight
    is replayed or, when the executor's cache is gone too, the prompt is computed (and
    scored) again from its start. Either way the stream in each store carries every prompt
    token's score once, in its first event, equal to an uninterrupted run's."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    prompt = list(range(100, 140))

    def run(store: StateStore, new: bool, steps: int = -1) -> LLMEngine:
        engine = journaled_engine(store, 1, max_num_batched_tokens=16)
        if kv_lost and not new:
            engine.executor_instance = "a restarted executor"
        engine.recover()
        if new:
            engine.add_request("scored", prompt, params)
        while engine.has_unfinished() and steps != 0:
            engine.step()
            steps -= 1
        engine.flush()
        return engine

    def prompt_scores(store: StateStore) -> list[list[PromptLogprob] | None]:
        events = [RequestDelta.from_json(text) for _, text in store.read_events("scored")]
        assert events[-1].finished
        return [event.prompt_logprobs for event in events]

    reference = InMemoryStateStore()
    run(reference, new=True)
    first, *rest = prompt_scores(reference)
    assert len(first) == len(prompt) - 1 and rest == [None] * len(rest)
    run(store, new=True, steps=kill_after)
    successor = run(store, new=False)
    if kv_lost:  # the whole prompt computed again
        assert successor.stats.num_prompt_tokens >= len(prompt)
    assert prompt_scores(store) == [first, *rest]


class _Sent:
    """Forwards steps to the executor and keeps the last one sent."""

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor
        self.last: ExecuteStep | None = None

    def execute(self, step: ExecuteStep) -> StepResult:
        self.last = step
        return self.executor.execute(step)


class _Replayed(Exception):
    def __init__(self, step: ExecuteStep) -> None:
        super().__init__(step.step_id)
        self.step = step


class _Capture:
    """Stands in for the executor of a restarted engine: stops it at the replay."""

    def execute(self, step: ExecuteStep) -> StepResult:
        raise _Replayed(step)


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_recovery_rebuilds_the_pending_step_equal_to_the_step_sent(
    journaled_engine: Callable[..., LLMEngine], num_decode_steps: int
) -> None:
    """The journal keeps the step in flight by sequence ids; after every step a restarted
    engine rebuilds it from the stored groups, field for field what the executor got (so
    the executor recognises the replay), for every kind of request; decode steps in a
    row come back with their number from the slots stored ahead."""
    store = InMemoryStateStore()
    engine = journaled_engine(store, num_decode_steps)
    engine.recover()
    sent = _Sent(engine.executor)
    engine.executor = sent
    penalties = SamplingParams(
        temperature=0.8, seed=4, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5
    )
    for i, (rid, params) in enumerate((REQUESTS | {"penalties": penalties}).items()):
        engine.add_request(rid, [100 + i, 200, 300, 400, 500], params)
    steps = most_steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        restarted = journaled_engine(store, num_decode_steps)
        restarted.executor = _Capture()
        with pytest.raises(_Replayed) as replay:
            restarted.recover(epoch=store.current_epoch())  # reads; takes no new epoch
        assert replay.value.step == sent.last, f"step {steps}"
        most_steps = max(most_steps, *(s.num_steps for s in sent.last.seqs))
    if num_decode_steps == 1:
        assert steps > COMPACT_AFTER  # deltas were compacted on the way
    assert most_steps == num_decode_steps


def test_recovery_returns_what_the_replayed_step_made(
    journaled_engine: Callable[..., LLMEngine],
) -> None:
    """A restart while the step that finishes a request is in flight: the replay finishes
    it again, and ``recover`` says so (the lane counts it; its stream ends from the
    journal, and no later step of this term sees the request)."""
    store = InMemoryStateStore()
    engine = journaled_engine(store, 1)
    engine.recover()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("a", [100, 200, 300], params)
    while not (last := engine.step()).finished:
        pass
    assert store.load().pending_step is not None  # its results wait for the next commit
    restarted = journaled_engine(store, 1)
    replayed = restarted.recover()
    assert [g.request_id for g in replayed.finished] == ["a"]
    (delta,) = replayed.deltas
    assert delta.finished and delta.outputs == last.deltas[0].outputs
    assert not restarted.has_unfinished()
    assert journaled_engine(InMemoryStateStore(), 1).recover() == StepOutcome()  # nothing
