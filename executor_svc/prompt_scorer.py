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
) -> dict[int, list[PromptLogprob]]:
    """The prompt tokens each sequence scores (``SeqStep.num_prompt_scored`` of them, in
    order), by the sequence's index in ``seqs``; only sequences that score some appear.

    Args:
        hidden: ``[num_tokens, hidden_size]``, the step's last hidden states, sequence i's
            new tokens in one run after sequence i-1's.
        seqs: the step's sequences in ``hidden``'s order.
        compute_logits: ``[rows, hidden_size]`` -> ``[rows, vocab_size]`` logits.
    """
    asking = [i for i, seq in enumerate(seqs) if seq.sampling_params.prompt_logprobs is not None]
    if not asking:  # the common case: one pass over the batch, nothing else
        return {}
    counts = {i: seqs[i].num_prompt_scored for i in asking}
    scoring = [i for i in asking if counts[i]]
    if not scoring:
        return {}
    starts = list(itertools.accumulate((len(seq.new_token_ids) for seq in seqs), initial=0))
    rows, targets = [], []
    for i in scoring:
        first = seqs[i].num_computed_tokens + 1  # the token that the logits at starts[i] score
        rows += range(starts[i], starts[i] + counts[i])
        targets += seqs[i].prompt_token_ids[first : first + counts[i]]
    num_top = max(seqs[i].sampling_params.prompt_logprobs for i in scoring)
    scored = []
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        hi = lo + ROWS_PER_SLICE
        scored += _score_rows(hidden, rows[lo:hi], targets[lo:hi], num_top, compute_logits)
    results, at = {}, 0
    for i in scoring:
        k = seqs[i].sampling_params.prompt_logprobs
        results[i] = [
            PromptLogprob(lp, rank, dict(itertools.islice(top.items(), k)))
            for lp, rank, top in scored[at : at + counts[i]]
        ]
        at += counts[i]
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
