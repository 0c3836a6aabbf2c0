"""The executor's grammar state on the default model's vocabulary: masks, replay, forks,
the end of a grammar, and what it refuses. Zero logits stand in for a model: the mask alone
decides what may be drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.grammar import GrammarMasks
from pagedserve.grammar import Grammar
from pagedserve.model_files import load_tokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SeqOutput, SeqStep

EOS = 2
DIGITS = Grammar("regex", "[0-9]{2}")


@pytest.fixture(scope="module")
def setup(smollm2_dir: Path) -> tuple[GrammarMasks, object]:
    tokenizer = load_tokenizer(smollm2_dir)
    return GrammarMasks(tokenizer, len(tokenizer), EOS), tokenizer


def seq(seq_id: int, grammar: Grammar, output: list[int], ignore_eos: bool = False) -> SeqStep:
    params = SamplingParams(temperature=0, grammar=grammar, ignore_eos=ignore_eos)
    return SeqStep(seq_id, [1], 5, [0], params, output_token_ids=output)


def allowed(masks: GrammarMasks, step: SeqStep, vocab_size: int) -> set[int]:
    logits = torch.zeros(1, vocab_size)
    masks.mask(logits, [step])
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


def test_a_matcher_follows_its_draws_and_is_rebuilt_from_the_output(setup) -> None:
    masks, tokenizer = setup
    vocab = len(tokenizer)
    digits = {t for t in range(vocab) if tokenizer.decode([t]) in set("0123456789")}
    first = seq(1, DIGITS, [])
    assert masks.check([first]) == {}
    assert allowed(masks, first, vocab) == digits
    seven = tokenizer.convert_tokens_to_ids("7")
    masks.accept([first], [SeqOutput(1, [seven], [0.0])])
    assert allowed(masks, seq(1, DIGITS, [seven]), vocab) == digits
    # Another process (or after a restart): the same output rebuilds the same state.
    fresh = GrammarMasks(tokenizer, vocab, EOS)
    done = seq(1, DIGITS, [seven, seven])
    assert fresh.check([done]) == {} and allowed(fresh, done, vocab) == {EOS}
    # A fork: the parent's row drew two samples; each child replays its own first token.
    masks.accept([first], [SeqOutput(1, [seven, seven], [0.0, 0.0])])
    assert allowed(masks, seq(2, DIGITS, [seven]), vocab) == digits


def test_past_the_end_only_eos_is_drawn(setup) -> None:
    masks, tokenizer = setup
    seven = tokenizer.convert_tokens_to_ids("7")
    ended = seq(3, DIGITS, [seven, seven, EOS], ignore_eos=True)
    assert masks.check([ended]) == {}
    assert allowed(masks, ended, len(tokenizer)) == {EOS}
    masks.accept([ended], [SeqOutput(3, [EOS], [0.0])])
    assert allowed(masks, seq(3, DIGITS, [seven, seven, EOS, EOS], True), len(tokenizer)) == {EOS}


def test_json_strings_hold_no_raw_control_character(setup) -> None:
    masks, tokenizer = setup
    quote = tokenizer.encode('{"a":"')
    step = seq(4, Grammar("json_schema", '{"type":"object"}'), [])
    masks.check([step])
    for token in tokenizer.encode('{"a":"'):
        masks.accept([step], [SeqOutput(4, [token], [0.0])])
        step = seq(4, step.sampling_params.grammar, [*step.output_token_ids, token])
    assert step.output_token_ids == quote
    texts = [tokenizer.decode([t]) for t in allowed(masks, step, len(tokenizer))]
    assert "a" in texts and not [t for t in texts if any(ord(c) < 32 for c in t)]


def test_a_bad_grammar_or_an_output_it_refuses_is_named(setup) -> None:
    masks, tokenizer = setup
    letter = tokenizer.convert_tokens_to_ids("x")
    refused = masks.check([seq(5, Grammar("regex", "(open"), []), seq(6, DIGITS, [letter])])
    assert set(refused) == {5, 6}
    assert "does not compile" in refused[5] and "breaks the grammar" in refused[6]
