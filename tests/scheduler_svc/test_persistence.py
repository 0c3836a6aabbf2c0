"""The JSON forms the journal writes read back to what was written."""

from __future__ import annotations

import json

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, SeqStep
from scheduler_svc.persistence import (
    group_from_json,
    group_to_json,
    step_from_json,
    step_to_json,
)
from scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus

PARAMS = SamplingParams(n=2, temperature=0.7, top_k=5, stop=("\n\n",), stop_token_ids=(2, 7))


def test_a_step_reads_back_equal() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4, seed=3)
    step = ExecuteStep(
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
    assert step_from_json(step_to_json(step)) == step


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


def test_another_schema_version_is_refused() -> None:
    text = json.loads(step_to_json(ExecuteStep(1, 1, [])))
    text["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        step_from_json(json.dumps(text))
