"""Structured outputs in the executor: compiled grammars, one matcher per sequence, and the
token masks they put on the logits before sampling."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from pagedserve.grammar import Grammar, GrammarError, parse_grammar
from pagedserve.step import SeqOutput, SeqStep

# Matchers kept for sequences not seen lately; one evicted too early is rebuilt by replay.
MAX_MATCHERS = 4096


@dataclass(slots=True)
class _Tracked:
    grammar: Grammar
    matcher: Any  # xgr.GrammarMatcher
    token_ids: list[int]  # the output tokens it has consumed


class GrammarMasks:
    """Keeps each constrained sequence's matcher in step with the tokens drawn for it.

    A matcher is trusted only while the tokens it consumed equal the output the step
    sends (``SeqStep.output_token_ids``); otherwise -- a sequence new to this process, a
    fork of parallel sampling, a group recomputed after a restart -- it is rebuilt by
    replaying that output. So the executor holds no state the scheduler cannot restore.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_token_id]
        )
        self.vocab_size = vocab_size
        # Masks in the engine's layout, [ceil(vocab_size / 32)] int32 each.
        self.eos_only = _pack([t == eos_token_id for t in range(vocab_size)], vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)  # caches what it compiled
        # JSON is compact, so it never holds a raw control character; the engine's string
        # rule lets all but CR and LF through, which strict JSON parsers refuse.
        safe = [min(text, default=32) >= 32 for text in info.decoded_vocab]
        self.json_safe = _pack(safe, vocab_size)
        self._matchers: OrderedDict[int, _Tracked] = OrderedDict()  # by seq_id, LRU

    def check(self, seqs: list[SeqStep]) -> dict[int, str]:
        """Compile every grammar of a step and bring each sequence's matcher up to its
        output, before the step touches the pools.

        Returns:
            Why, by seq_id, for each sequence whose grammar does not compile or refuses its
            output: those are left out of the step, and their requests end with the error.
        """
        refused = {}
        for seq in seqs:
            if seq.sampling_params.grammar is not None:
                try:
                    self._matcher(seq)
                except GrammarError as e:
                    refused[seq.seq_id] = f"the grammar does not compile: {e}"
        return refused

    def mask(self, logits: torch.Tensor, seqs: list[SeqStep]) -> None:
        """Set the logits of every token a sequence's grammar forbids to -inf, in place;
        past the grammar's end only end-of-sequence is left (drawn on by ``ignore_eos``).

        Args:
            logits: ``[num_seqs, vocab_size]``, row ``i`` for ``seqs[i]``.
        """
        rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.grammar is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # [num_seqs, words]
        for i in rows:
            matcher = self._matcher(seqs[i]).matcher
            if matcher.is_terminated():
                bitmask[i] = self.eos_only
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
                if seqs[i].sampling_params.grammar.kind == "json_schema":
                    bitmask[i] &= self.json_safe
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def accept(self, seqs: list[SeqStep], outputs: list[SeqOutput]) -> None:
        """Advance each constrained sequence's matcher by the token drawn for it. A row that
        drew several samples (a parallel-sampling group's first step) forks: each child
        rebuilds its own matcher from its output at its next step."""
        for seq, output in zip(seqs, outputs, strict=True):
            if seq.sampling_params.grammar is None:
                continue
            if len(output.token_ids) != 1:
                self._matchers.pop(seq.seq_id, None)
                continue
            tracked = self._matcher(seq)
            accepted = _consume(tracked.matcher, output.token_ids[0])
            assert accepted, f"seq {seq.seq_id} drew a token outside its grammar's mask"
            tracked.token_ids.append(output.token_ids[0])

    def _matcher(self, seq: SeqStep) -> _Tracked:
        """The sequence's matcher, rebuilt by replaying its output unless it is current.
        Raises GrammarError when the grammar does not compile or refuses that output."""
        grammar = seq.sampling_params.grammar
        assert grammar is not None
        tracked = self._matchers.get(seq.seq_id)
        current = tracked is not None and tracked.grammar == grammar
        if not (current and tracked.token_ids == seq.output_token_ids):
            matcher = xgr.GrammarMatcher(self.compiler.compile_grammar(parse_grammar(grammar)))
            for index, token_id in enumerate(seq.output_token_ids):
                if not _consume(matcher, token_id):
                    raise GrammarError(f"output token {index} ({token_id}) breaks the grammar")
            tracked = _Tracked(grammar, matcher, list(seq.output_token_ids))
            self._matchers[seq.seq_id] = tracked
            if len(self._matchers) > MAX_MATCHERS:
                self._matchers.popitem(last=False)
        self._matchers.move_to_end(seq.seq_id)
        return tracked


def _pack(allowed: list[bool], vocab_size: int) -> torch.Tensor:
    """The engine's bitmask layout: token t is bit t % 32 of int32 word t // 32; tokens
    past ``allowed`` are not.

    Returns:
        ``[ceil(vocab_size / 32)]`` int32.
    """
    words = -(-vocab_size // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    allowed = allowed[:vocab_size]
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)  # in [0, 2**32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _consume(matcher: Any, token_id: int) -> bool:
    """Feed one token; whether the grammar allows it. Past the grammar's end every token
    is end-of-sequence (see ``GrammarMasks.mask``) and leaves the matcher as it is."""
    return matcher.is_terminated() or matcher.accept_token(token_id)
