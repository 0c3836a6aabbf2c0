"""The executor API's pb conversions: what a step or a result carries is what arrives."""

from __future__ import annotations

import pytest

from pagedserve.rpc.convert import (
    ParamsCache,
    result_from_pb,
    result_to_pb,
    step_from_pb,
    step_to_pb,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, PromptLogprob, SeqOutput, SeqStep, StepResult


def _step(step_id: int, params: list[SamplingParams]) -> ExecuteStep:
    seqs = [SeqStep(i, [7 + i], 16 * i, [i], p) for i, p in enumerate(params)]
    return ExecuteStep(step_id, 1, seqs)


def test_parameters_converted_in_an_earlier_step_are_sent_the_same() -> None:
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)
    known: ParamsCache = {}
    first = _step(1, [greedy, sampled])
    assert step_to_pb(first, known) == step_to_pb(first)
    assert {id(p) for p, _, _ in known.values()} == {id(greedy), id(sampled)}
    # The next step: one request left, a new one came with parameters of its own.
    newcomer = SamplingParams(temperature=0.0, top_k=5)
    second = _step(2, [sampled, newcomer])
    assert step_to_pb(second, known) == step_to_pb(second)
    assert step_from_pb(step_to_pb(second, known)) == second
    assert [p for p, _, _ in known.values()] == [sampled, newcomer]  # the departed one is gone


def test_equal_parameters_go_once_into_a_step() -> None:
    """Each request has its own SamplingParams object; equal ones are sent once."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=9) for _ in range(3)]
    other = SamplingParams(temperature=0.7)
    step = _step(1, [greedy[0], other, greedy[1], greedy[2]])
    message = step_to_pb(step)
    assert len(message.sampling_params) == 2
    assert [s.sampling_params_index for s in message.seqs] == [0, 1, 0, 0]
    assert step_from_pb(message) == step


def test_every_list_of_a_sequence_arrives_and_a_follower_sends_its_new_entries() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    prefill = SeqStep(1, [5, 6, 7], 0, [3, 4], params, prompt_token_ids=[5, 6, 7])
    decode = SeqStep(2, [9], 40, [8], params, prompt_token_ids=[1], output_token_ids=[2, 9])
    follower = SeqStep(3, [], 0, [10, 11, 12], params, num_steps=2, follows=True, table_start=2)
    quiet = SeqStep(4, [], 0, [13], params, follows=True, table_start=1)  # nothing new
    back = step_from_pb(step_to_pb(ExecuteStep(3, 1, [prefill, decode, follower, quiet], [])))
    assert back.seqs[:2] == [prefill, decode]
    assert back.seqs[2].block_table == [12] and back.seqs[2].table_start == 2
    assert back.seqs[3].block_table == [] and back.seqs[3].follows


def test_followers_that_end_a_step_go_in_columns_and_arrive_in_order() -> None:
    """Those of a call sent ahead, one column per field; a follower before another
    sequence, or one with token lists, goes as a message of its own."""
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    early = SeqStep(1, [], 0, [4], greedy, follows=True)
    prefill = SeqStep(2, [5, 6, 7], 0, [3], greedy)
    history = SeqStep(3, [], 0, [8], penalized, output_token_ids=[2, 9], follows=True)
    ahead = [
        SeqStep(10, [], 0, [20, 21, 22], greedy, num_steps=2, follows=True, table_start=2),
        SeqStep(11, [], 0, [], seeded, sample_index=1, follows=True),
        SeqStep(12, [], 0, [23, 24], greedy, follows=True),
    ]
    message = step_to_pb(ExecuteStep(4, 1, [early, prefill, history, *ahead], follows_step_id=3))
    assert [s.seq_id for s in message.seqs] == [1, 2, 3]
    columns = message.followers
    assert list(columns.seq_ids) == [10, 11, 12]
    assert list(columns.sampling_params_index) == [0, 2, 0]
    assert list(columns.table_lengths) == [1, 0, 2]
    assert list(columns.table_entries) == [22, 23, 24]
    back = step_from_pb(message)
    assert back.seqs[:3] == [early, prefill, history]
    # The entries before table_start stay unsent, as in a message of its own.
    assert back.seqs[3:] == [
        SeqStep(10, [], 0, [22], greedy, num_steps=2, follows=True, table_start=2),
        *ahead[1:],
    ]


@pytest.mark.parametrize(
    ("column", "value", "why"),
    [
        ("sample_index", [0, 0], "followers.sample_index: 2 entries, 1 seq_ids"),
        ("table_entries", [4, 5, 1], "followers.table_entries: 3, table_lengths 2"),
        ("sampling_params_index", [1], r"followers.sampling_params_index\[0\]: 1 of 1"),
    ],
)
def test_columns_of_followers_that_do_not_add_up_are_refused(
    column: str, value: list[int], why: str
) -> None:
    follower = SeqStep(1, [], 0, [4, 5], SamplingParams(), follows=True)
    message = step_to_pb(ExecuteStep(2, 1, [follower], follows_step_id=1))
    entries = getattr(message.followers, column)
    del entries[:]
    entries.extend(value)
    with pytest.raises(ValueError, match=why):
        step_from_pb(message)


def test_a_sequence_naming_no_parameters_is_refused() -> None:
    message = step_to_pb(_step(1, [SamplingParams()]))
    message.seqs[0].sampling_params_index = 1
    with pytest.raises(ValueError, match="sampling_params_index: 1 of 1"):
        step_from_pb(message)


def test_results_of_drawn_tokens_alone_go_in_columns_and_come_back_equal() -> None:
    one_step = StepResult(3, [SeqOutput(i, [100 + i], [-0.25 * i]) for i in range(4)])
    in_a_row = StepResult(
        4, [SeqOutput(7, [1, 2, 3], [-1.0, -2.0, -3.0]), SeqOutput(2, [9], [0.0])]
    )
    for result in (one_step, in_a_row, StepResult(5, [])):
        message = result_to_pb(result)
        assert message.HasField("drawn") and not message.outputs
        assert result_from_pb(message) == result
    # Anything more than tokens and logprobs: one message per output, in request order.
    mixed = StepResult(
        6,
        [
            SeqOutput(1, [5], [-0.5], top_logprobs=[{5: -0.5, 6: -1.5}]),
            SeqOutput(2, [], [], error="grammar refused"),
            SeqOutput(3, [8], [-0.1], prompt_logprobs=[PromptLogprob(-2.0, 3, {4: -1.0})]),
            SeqOutput(4, [9], [-0.2]),
        ],
    )
    message = result_to_pb(mixed)
    assert not message.HasField("drawn") and len(message.outputs) == 4
    assert result_from_pb(message) == mixed


def test_columns_that_do_not_add_up_are_refused() -> None:
    message = result_to_pb(StepResult(3, [SeqOutput(1, [5, 6], [-0.5, -0.6])]))
    message.drawn.counts[0] = 3
    with pytest.raises(ValueError, match="2 tokens, 2 logprobs, counts 3"):
        result_from_pb(message)
