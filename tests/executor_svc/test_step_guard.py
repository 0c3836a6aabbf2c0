"""The executor's step checks accept block-table entries freed outside a sliding window (-1)
exactly where no kernel reads them; its ledger keeps the last steps applied."""

from __future__ import annotations

import pytest

from executor_svc.step_guard import KEPT_STEPS, InvalidArgument, StepLedger, validate_step
from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import NO_BLOCK, ExecuteStep, SeqStep, StepResult


def _info(sliding_window: int) -> ModelInfo:
    return ModelInfo("m", 512, 1024, None, 4, 16, 4, sliding_window=sliding_window)


def _step(block_table: list[int], num_computed_tokens: int = 20) -> ExecuteStep:
    """A decode step at position 20 (window 8 sees 13..20: blocks 3..5 of 4 tokens)."""
    seq = SeqStep(0, [5], num_computed_tokens, block_table, SamplingParams(temperature=0.0))
    return ExecuteStep(0, 0, [seq])


def test_entries_wholly_before_the_window_may_be_freed() -> None:
    validate_step(_step([NO_BLOCK] * 3 + [7, 8, 9]), _info(8))


@pytest.mark.parametrize(
    ("table", "window", "message"),
    [
        ([NO_BLOCK] * 4 + [8, 9], 8, r"block_table\[3\]: freed \(-1\), but position 20"),
        ([NO_BLOCK, 6, 7, 8, 9, 10], 0, r"block_table\[0\]: freed \(-1\)"),  # a global layer
        ([5, NO_BLOCK, 7, 8, 9, 10], 8, r"block_table\[1\]: block id -1 outside"),
    ],
)
def test_a_freed_entry_a_kernel_would_read_is_refused(table, window, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_step(_step(table), _info(window))


def test_the_ledger_hands_back_each_step_it_stops_keeping() -> None:
    """What ``record`` no longer keeps goes to the caller (the server frees it off the
    step's path), and only that: a kept step is still answered as a replay."""
    ledger, results = StepLedger(), [StepResult(i, []) for i in range(KEPT_STEPS + 2)]
    dropped = [ledger.record(i, 1, bytes([i]), result) for i, result in enumerate(results)]
    assert [[d.result for d in ds] for ds in dropped] == [[]] * KEPT_STEPS + [
        [results[0]],
        [results[1]],
    ]
    assert ledger.judge(2, 1, bytes([2])) is results[2]
    assert ledger.judge(len(results), 1, b"new") is None
