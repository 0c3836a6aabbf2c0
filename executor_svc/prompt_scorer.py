"""Scores prompt tokens for the sequences of a step that ask for prompt logprobs: the
log-softmax of the raw logits at their prompt positions. Sequences that do not ask cost
nothing: only the last position of each is turned into logits, as before."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from pagedserve.step import PromptLogprob, SeqStep

# Rows turned into logits at once: [256, vocab_size] fp32 is 48 MiB at 49,152 tokens, so a
# prompt chunk of thousands of tokens never holds all of its logits together.
ROWS_PER_SLICE = 256


def score_prompts(
    hidden: torch.Tensor,
    seqs: list[SeqStep],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[PromptLogprob]]:
    """Each sequence's scored prompt tokens (``SeqStep.num_prompt_scored`` of them, in
    order), empty for a sequence that scores none.

    Args:
        hidden: ``[num_tokens, hidden_size]``, the step's last hidden states, sequence i's
            new tokens in one run after sequence i-1's.
        seqs: the step's sequences in ``hidden``'s order.
        compute_logits: ``[rows, hidden_size]`` -> ``[rows, vocab_size]`` logits.
    """
    counts = [seq.num_prompt_scored for seq in seqs]
    results: list[list[PromptLogprob]] = [[] for _ in seqs]
    if not any(counts):
        return results
    starts = itertools.accumulate((len(seq.new_token_ids) for seq in seqs), initial=0)
    rows, targets = [], []
    for seq, start, count in zip(seqs, starts, counts, strict=False):
        first = seq.num_computed_tokens + 1  # the token that the logits at start score
        rows += range(start, start + count)
        targets += seq.prompt_token_ids[first : first + count]
    num_top = max(seq.sampling_params.prompt_logprobs or 0 for seq in seqs)
    scored = []
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        hi = lo + ROWS_PER_SLICE
        scored += _score_rows(hidden, rows[lo:hi], targets[lo:hi], num_top, compute_logits)
    at = 0
    for i, (seq, count) in enumerate(zip(seqs, counts, strict=True)):
        k = seq.sampling_params.prompt_logprobs or 0
        results[i] = [
            PromptLogprob(lp, rank, dict(itertools.islice(top.items(), k)))
            for lp, rank, top in scored[at : at + count]
        ]
        at += count
    return results


def _score_rows(
    hidden: torch.Tensor,
    rows: list[int],
    targets: list[int],
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[float, int, dict[int, float]]]:
    """(logprob, rank, top ``num_top``) of ``targets[j]`` under row ``rows[j]``'s logits."""
    device = hidden.device
    logits = compute_logits(hidden[torch.tensor(rows, device=device)])  # [rows, vocab_size]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=device).unsqueeze(1))  # [rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # the token itself included
    top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return [
        (lp, rank, dict(zip(ids, values, strict=True)))
        for lp, rank, ids, values in zip(
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top.indices.tolist(),
            top.values.tolist(),
            strict=True,
        )
    ]
