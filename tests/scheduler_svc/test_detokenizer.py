"""Incremental detokenization with the default model's tokenizer: tokens fed one at a time
or several at once (decode steps in a row) give the same text, and characters split over
byte tokens never come out half."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.model_files import load_tokenizer
from scheduler_svc.core.sequence import Sequence
from scheduler_svc.engine.detokenizer import Detokenizer

TEXT = "Café naïve — 東京の夜 🚀🌊 done.\n  Indented  spaces and ünïcödé at the end: 🎉"


@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_text_is_the_same_however_many_tokens_arrive_at_once(smollm2_dir: Path, chunk: int):
    tokenizer = load_tokenizer(smollm2_dir)
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))
    detokenizer, seq = Detokenizer(tokenizer), Sequence(0, [1])
    complete = [i for i in range(len(ids) + 1) if not tokenizer.decode(ids[:i]).endswith("\ufffd")]
    for start in range(0, len(ids), chunk):
        for token_id in ids[start : start + chunk]:
            seq.append_token(token_id, 0.0)
        detokenizer.update(seq)
        end = len(seq.output_token_ids)
        assert seq.output_text == tokenizer.decode(ids[: seq.read_offset])
        assert seq.read_offset == max(i for i in complete if i <= end)  # nothing held back
    assert seq.output_text == tokenizer.decode(ids) == TEXT


class _CleaningTokenizer:
    """A fast tokenizer that cleans up spaces: only its own decode knows how."""

    clean_up_tokenization_spaces = True

    class backend_tokenizer:
        @staticmethod
        def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
            return "raw "

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
        return "cleaned" * len(ids)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_own_decode() -> None:
    seq = Sequence(0, [1], [5, 6])
    Detokenizer(_CleaningTokenizer()).update(seq)
    assert seq.output_text == "cleanedcleaned"
