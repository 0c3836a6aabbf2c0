"""Sequence: token ranges read across the prompt and the output."""

from __future__ import annotations

from scheduler_svc.core.sequence import Sequence


def test_token_ids_between_equals_a_slice_of_the_whole() -> None:
    seq = Sequence(0, [10, 11, 12, 13], [20, 21, 22])
    whole = seq.get_token_ids()
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.get_token_ids_between(start, end) == whole[start:end], (start, end)
    part = seq.get_token_ids_between(0, 2)
    part.append(99)  # a copy: the sequence keeps its tokens
    assert seq.prompt_token_ids == [10, 11, 12, 13]
