"""The JSON forms the journal writes read back to what was written."""

from __future__ import annotations

import json

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import NO_BLOCK, ExecuteStep, SeqStep
from scheduler_svc.core.output_text import OutputText
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.state.persistence import (
    PendingStep,
    group_delta,
    group_from_json,
    group_to_json,
    step_from_json,
    step_to_json,
    stored_mark,
)
from scheduler_svc.state.streams import RequestDelta, SeqDelta

PARAMS = SamplingParams(n=2, temperature=0.7, top_k=5, stop=("\n\n",), stop_token_ids=(2, 7))


def _step() -> ExecuteStep:
    greedy = SamplingParams(temperature=0.0, max_tokens=4, seed=3)
    return ExecuteStep(
        step_id=12,
        epoch=3,
        seqs=[
            SeqStep(1, [5, 6, 7], 0, [4, 9], PARAMS, num_samples=2),
            SeqStep(2, [8], 40, [1, 2, 3], PARAMS, sample_index=1),
            SeqStep(3, [9], 17, [5, 6], greedy, prompt_token_ids=[1, 2], output_token_ids=[3]),
        ],
        blocks_to_swap_out=[(4, 0)],
        blocks_to_swap_in=[(1, 7)],
        blocks_to_copy=[(2, 8), (3, 9)],
    )


def test_a_pending_step_keeps_its_sequence_ids_in_order_and_its_block_moves() -> None:
    assert step_from_json(step_to_json(_step())) == PendingStep(
        12, [1, 2, 3], [(4, 0)], [(1, 7)], [(2, 8), (3, 9)]
    )


def test_a_version_1_pending_step_still_reads() -> None:
    """Version 1 wrote each sequence whole; a scheduler upgraded mid-flight reads its ids."""
    step = _step()
    seqs = [
        {"seq_id": s.seq_id, "new_token_ids": s.new_token_ids, "sampling_params": {}}
        for s in step.seqs
    ]
    pairs = {"blocks_to_swap_out": [[4, 0]], "blocks_to_swap_in": [[1, 7]], "blocks_to_copy": []}
    text = json.dumps({"version": 1, "step": {"step_id": 12, "epoch": 3, "seqs": seqs} | pairs})
    assert step_from_json(text) == PendingStep(12, [1, 2, 3], [(4, 0)], [(1, 7)], [])


def test_a_group_reads_back_equal_with_its_block_tables() -> None:
    seqs = [
        Sequence(1, [10, 11, 12], [13, 14], SequenceStatus.RUNNING, -1.5, 4, [-0.5, -1.0]),
        Sequence(2, [10, 11, 12], [15], SequenceStatus.SWAPPED, output_top_logprobs=[{15: -0.1}]),
    ]
    group = SequenceGroup("req-1", seqs, 123.5, PARAMS, num_preemptions=1)
    tables = {1: ([3, 4], 5), 2: ([3, 6], 4)}
    restored = group_from_json(group_to_json(group, "running", tables))
    assert restored.group == group
    assert restored.queue == "running"
    assert restored.block_tables == tables


def _running_group() -> tuple[SequenceGroup, dict[int, tuple[list[int], int]]]:
    seqs = [
        Sequence(1, [10, 11, 12], [13], SequenceStatus.RUNNING, -0.5, 3, [-0.5], [{13: -0.5}]),
        Sequence(2, [10, 11, 12], [], SequenceStatus.WAITING),
    ]
    seqs[0].output_text, seqs[0].prefix_offset, seqs[0].read_offset = OutputText("Hi"), 0, 1
    return SequenceGroup("req-2", seqs, 7.0, PARAMS), {1: ([3], 4)}


def test_a_group_grown_by_steps_reads_back_from_its_deltas() -> None:
    group, tables = _running_group()
    stored = group_to_json(group, "running", tables)
    mark = stored_mark(group, tables)
    blocks = {1: [3], 2: []}  # the second sequence gets its first block at step 0
    for step in range(3):
        first, second = group.seqs
        first.append_token(20 + step, -0.25, {20 + step: -0.25, 9: -2.0})
        first.num_computed_tokens += 1
        first.output_text += ' "ü\n🦙'  # what a JSON line must escape
        first.prefix_offset, first.read_offset = first.read_offset, len(first.output_token_ids)
        second.status = SequenceStatus.RUNNING
        blocks[1].append(5 + step)
        blocks[2].append(8 + step)
        if step == 2:
            first.status, group.num_preemptions = SequenceStatus.FINISHED_LENGTH, 1
        tables = {seq_id: (list(table), 4 + step) for seq_id, table in blocks.items()}
        delta = group_delta(group, "swapped", tables, mark)
        assert delta is not None and "\n" not in delta
        stored += "\n" + delta
        mark = stored_mark(group, tables)
    restored = group_from_json(stored)
    assert restored.group == group
    assert restored.queue == "swapped"
    assert restored.block_tables == {1: ([3, 5, 6, 7], 6), 2: ([8, 9, 10], 6)}


def _fork(group: SequenceGroup) -> None:
    group.seqs.append(group.seqs[0].fork(3))


def _cut_at_stop(group: SequenceGroup) -> None:
    group.seqs[0].output_text.cut(1)


def _reorder(group: SequenceGroup) -> None:
    group.seqs.reverse()


@pytest.mark.parametrize(
    ("change", "tables"),
    [
        (_fork, {1: ([3], 4)}),
        (_cut_at_stop, {1: ([3], 4)}),
        (_reorder, {1: ([3], 4)}),
        (None, {1: ([9], 4)}),  # swapped out: the block moved
        (None, {}),  # preempted for recompute: the blocks are gone
    ],
)
def test_a_change_that_is_not_an_append_has_no_delta(change, tables) -> None:
    group, old_tables = _running_group()
    mark = stored_mark(group, old_tables)
    if change is not None:
        change(group)
    assert group_delta(group, "running", tables, mark) is None


def test_a_stream_event_reads_back_equal() -> None:
    outputs = [
        SeqDelta(0, ' "ü\n', [5, 6], [-0.5, -1.0], [{5: -0.5, 9: -2.0}, {6: -1.0}]),
        SeqDelta(1, "", [], [], [], finish_reason="length"),
    ]
    event = RequestDelta("req-3", 12, event=4, outputs=outputs, finished=True)
    assert RequestDelta.from_json(event.to_json()) == event


def test_another_schema_version_is_refused() -> None:
    text = json.loads(step_to_json(ExecuteStep(1, 1, [])))
    text["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        step_from_json(json.dumps(text))


def test_blocks_freed_outside_a_sliding_window_ride_on_deltas() -> None:
    """A table whose leading blocks were freed (-1) while it grew is still an append: the
    delta carries how many lead entries are freed, and the stored group reads back equal."""
    group, tables = _running_group()
    stored = group_to_json(group, "running", tables)
    mark = stored_mark(group, tables)
    for table in ([NO_BLOCK, 5], [NO_BLOCK, 5, 6], [NO_BLOCK, NO_BLOCK, 6, 7]):
        group.seqs[0].append_token(20, -0.25, {20: -0.25})
        tables = {1: (table, len(table) * 4)}
        delta = group_delta(group, "running", tables, mark)
        assert delta is not None
        stored += "\n" + delta
        mark = stored_mark(group, tables)
    assert group_from_json(stored).block_tables == {1: ([NO_BLOCK, NO_BLOCK, 6, 7], 16)}
