"""The executor API's pb conversions: what a step carries is what arrives."""

from __future__ import annotations

from pagedserve.rpc.convert import ParamsCache, step_from_pb, step_to_pb
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, SeqStep


def _step(step_id: int, params: list[SamplingParams]) -> ExecuteStep:
    seqs = [SeqStep(i, [7 + i], 16 * i, [i], p) for i, p in enumerate(params)]
    return ExecuteStep(step_id, 1, seqs)


def test_parameters_converted_in_an_earlier_step_are_sent_the_same() -> None:
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)
    known: ParamsCache = {}
    first = _step(1, [greedy, sampled])
    assert step_to_pb(first, known) == step_to_pb(first)
    assert {id(p) for p, _ in known.values()} == {id(greedy), id(sampled)}
    # The next step: one request left, a new one came with parameters of its own.
    newcomer = SamplingParams(temperature=0.0, top_k=5)
    second = _step(2, [sampled, newcomer])
    assert step_to_pb(second, known) == step_to_pb(second)
    assert step_from_pb(step_to_pb(second, known)) == second
    assert [p for p, _ in known.values()] == [sampled, newcomer]  # the departed one is gone
