"""Turns one step's next-token logits into drawn tokens and their logprobs, batched."""

from __future__ import annotations

import hashlib

import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SeqOutput, SeqStep
from pagedserve_kernels import sampling_ops


class Sampler:
    """Draws every sequence's tokens with a handful of batched ops over the whole step.

    The logprob reported for a token (chosen or top alternative) is
    ``log_softmax(penalized_logits / temperature)`` -- temperature 0 divides by nothing --
    taken *before* top-k / top-p / min-p truncation, so it measures how likely the model
    found the token rather than how the truncated draw treated it.
    """

    def __call__(self, logits: torch.Tensor, seqs: list[SeqStep]) -> list[SeqOutput]:
        """Draw ``seq.num_samples`` tokens for each row; mutates nothing passed in.

        Args:
            logits: ``[num_seqs, vocab_size]`` next-token logits, row ``i`` for ``seqs[i]``.
        Raises:
            ValueError: the rows do not match ``seqs``, or a beam asks for more tokens
                than the vocabulary holds.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} seqs")
        if not seqs:
            return []
        if all(_plain_greedy(seq) for seq in seqs):
            token_ids, chosen = sampling_ops.greedy(logits)
            pairs = zip(seqs, token_ids.tolist(), chosen.tolist(), strict=True)
            return [SeqOutput(seq.seq_id, [token], [logprob], []) for seq, token, logprob in pairs]
        vocab_size = logits.shape[1]
        for seq in seqs:
            if seq.sampling_params.use_beam_search and seq.num_samples > vocab_size:
                raise ValueError(f"seq {seq.seq_id}: {seq.num_samples} beams > vocab")
        logits = _apply_penalties(logits.float(), seqs)
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in _params(seqs)]
        if any(t != 1.0 for t in temps):  # a full pass over the vocabulary: skip it if we can
            logits = logits / torch.tensor(temps, device=logits.device).unsqueeze(1)
        logprobs = torch.log_softmax(logits, dim=-1)  # [num_seqs, vocab_size]
        token_ids = _draw(logits, logprobs, seqs)  # [num_seqs, max_samples]
        return _build_outputs(logprobs, token_ids, seqs)


def _plain_greedy(seq: SeqStep) -> bool:
    """One argmax token with its logprob and nothing else: the common case, one fused pass."""
    p = seq.sampling_params
    plain = p.temperature == 0 and not p.use_beam_search and not p.has_penalties
    return plain and seq.num_samples == 1 and not p.logprobs


def _params(seqs: list[SeqStep]) -> list[SamplingParams]:
    return [seq.sampling_params for seq in seqs]


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[len(token_lists), vocab_size]`` occurrence counts, built with one scatter."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = [tokens + [vocab_size] * (width - len(tokens)) for tokens in token_lists]
    index = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(token_lists), -1)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, seqs: list[SeqStep]) -> torch.Tensor:
    """Repetition (CTRL: over prompt and output), presence and frequency (OpenAI: over
    the output) penalties on a copy of ``logits``; rows without a penalty pass through.

    Args:
        logits: ``[num_seqs, vocab_size]``.
    """
    rows = [
        i
        for i, seq in enumerate(seqs)
        if seq.sampling_params.has_penalties and (seq.prompt_token_ids or seq.output_token_ids)
    ]
    if not rows:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    output_counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab_size, device)
    prompt_counts = _token_counts([seqs[i].prompt_token_ids for i in rows], vocab_size, device)
    params = [seqs[i].sampling_params for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device).unsqueeze(1)

    repetition = column([p.repetition_penalty for p in params])
    presence = column([p.presence_penalty for p in params])
    frequency = column([p.frequency_penalty for p in params])
    in_output = output_counts > 0
    rows_t = torch.tensor(rows, device=device)
    sub = logits[rows_t]  # [num_penalized, vocab_size]
    repeated = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(in_output | (prompt_counts > 0), repeated, sub)
    sub = sub - frequency * output_counts - presence * in_output.float()
    logits = logits.clone()
    logits[rows_t] = sub
    return logits


def _draw(logits: torch.Tensor, logprobs: torch.Tensor, seqs: list[SeqStep]) -> torch.Tensor:
    """Token ids, greedy by default, overwritten for beam rows and sampled rows; columns
    past a row's ``num_samples`` are padding. The greedy choice is the logits' argmax, as on
    the fused greedy path, so a greedy row draws the same token in any batch.

    Args:
        logits: ``[num_seqs, vocab_size]`` penalized, scaled logits.
        logprobs: their log-softmax.
    Returns:
        ``[num_seqs, max_samples]`` long.
    """
    device = logprobs.device
    max_samples = max(seq.num_samples for seq in seqs)
    params = _params(seqs)
    if all(p.temperature > 0 and not p.use_beam_search for p in params):
        token_ids = torch.zeros(len(seqs), max_samples, dtype=torch.long, device=device)
    else:
        token_ids = logits.argmax(dim=-1, keepdim=True).repeat(1, max_samples)
    beam_rows = [i for i, p in enumerate(params) if p.use_beam_search]
    if beam_rows:
        num_beams = max(seqs[i].num_samples for i in beam_rows)
        beam_t = torch.tensor(beam_rows, device=device)
        # Beam search runs at temperature 0, so these are the unscaled logprobs.
        token_ids[beam_t, :num_beams] = logprobs[beam_t].topk(num_beams, dim=-1).indices
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0 and not p.use_beam_search]
    if random_rows:
        random_t = torch.tensor(random_rows, device=device)
        random_seqs = [seqs[i] for i in random_rows]
        rows_logprobs = logprobs if len(random_rows) == len(seqs) else logprobs[random_t]
        probs = _probs(rows_logprobs, _params(random_seqs))
        rows = [i for i in random_rows for _ in range(seqs[i].num_samples)]
        cols = [j for i in random_rows for j in range(seqs[i].num_samples)]
        draws = _inverse_cdf(probs, random_seqs)  # [sum(num_samples)]
        token_ids[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = draws
    return token_ids


def _probs(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row draws from: truncated where its parameters ask (a sort of
    the vocabulary per row), else the softmax alone, which is what truncation that drops
    nothing computes, so a row's result never depends on its neighbours' parameters.

    Args:
        logprobs: ``[num_rows, vocab_size]`` scaled log-probabilities.
    """
    vocab_size = logprobs.shape[1]
    truncates = [0 < p.top_k < vocab_size or p.top_p < 1 or p.min_p > 0 for p in params]
    if not any(truncates):
        return logprobs.softmax(dim=-1)
    if all(truncates):
        return _truncated_probs(logprobs, params)
    probs = logprobs.softmax(dim=-1)
    rows = [i for i, t in enumerate(truncates) if t]
    rows_t = torch.tensor(rows, device=logprobs.device)
    probs[rows_t] = _truncated_probs(logprobs[rows_t], [params[i] for i in rows])
    return probs


# Top-k and top-p look for their survivors among this many most likely tokens (a partial
# sort); a row sorts its whole vocabulary only when its nucleus reaches past them.
NUM_CANDIDATES = 1024


def _truncated_probs(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Renormalised probabilities after top-k, then top-p over what top-k kept, then min-p.

    The most likely token always survives. Which path a row takes (candidates or a full
    sort) depends on its own parameters and logits only, so a row's result never depends
    on the batch.

    Args:
        logprobs: ``[num_rows, vocab_size]`` scaled log-probabilities.
    Returns:
        ``[num_rows, vocab_size]``.
    """
    device, vocab_size = logprobs.device, logprobs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    # top_p 1.0 means off: a bound above any cumulative sum, rounding included.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params], device=device)
    keep = _nucleus(logprobs, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = logprobs.exp()
        keep &= probs >= min_p * probs.max(dim=-1, keepdim=True).values
    return logprobs.masked_fill(~keep, float("-inf")).softmax(dim=-1)


def _nucleus(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """What top-k and then top-p keep, ``[num_rows, vocab_size]`` bool: found among the
    ``NUM_CANDIDATES`` most likely tokens, where a row's survivors all lie when its top-k
    is within them or the candidates' mass already reaches its top-p."""
    vocab_size = logprobs.shape[1]
    width = min(NUM_CANDIDATES, vocab_size)
    values, order = logprobs.topk(width, dim=-1)  # descending
    within_k = top_k <= width
    # Top-k renormalises over the k it keeps; without top-k, over the whole vocabulary.
    total = torch.where(
        within_k,
        _masked_ranks(values, top_k).logsumexp(dim=-1),
        logprobs.logsumexp(dim=-1),
    )
    keep_sorted = _kept_ranks(values.sub(total.unsqueeze(1)).exp(), top_k, top_p)
    keep = torch.zeros_like(logprobs, dtype=torch.bool).scatter(1, order, keep_sorted)

    if width == vocab_size:
        return keep
    no_top_k = top_k >= vocab_size
    keep[no_top_k & (top_p > 1)] = True  # neither top-k nor top-p: nothing dropped
    # A top-k past the candidates, or a nucleus that may reach past them (the last one kept).
    to_sort = ~within_k & ~no_top_k | no_top_k & (top_p <= 1) & keep_sorted[:, -1]
    if bool(to_sort.any()):
        rows = to_sort.nonzero().squeeze(1)
        keep[rows] = _sorted_nucleus(logprobs[rows], top_k[rows], top_p[rows])
    return keep


def _masked_ranks(sorted_values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    ranks = torch.arange(sorted_values.shape[1], device=sorted_values.device)
    return sorted_values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))


def _kept_ranks(
    sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Ranks top-k and top-p keep, given probabilities in descending order (top-k's
    renormalisation already applied)."""
    ranks = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks >= top_k.unsqueeze(1), 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (ranks < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
    keep[:, 0] = True
    return keep


def _sorted_nucleus(
    logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The same as ``_nucleus`` by sorting every row's whole vocabulary."""
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    sorted_probs = _masked_ranks(sorted_logprobs, top_k).softmax(dim=-1)
    keep_sorted = _kept_ranks(sorted_probs, top_k, top_p)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _inverse_cdf(probs: torch.Tensor, seqs: list[SeqStep]) -> torch.Tensor:
    """Independent draws, one uniform number per sample looked up in its row's cumulative
    distribution (one number per sample, not per vocabulary entry as a race of noise
    needs); a seeded row's numbers come from its own generator, so its draws ignore every
    other row.

    A number u in (0, 1] finds the first token whose running sum reaches u times the
    row's total: that token has mass, and rounding cannot carry u past the last one.

    Args:
        probs: ``[num_rows, vocab_size]``, row ``i`` for ``seqs[i]``.
    Returns:
        ``[sum(num_samples)]`` long, row 0's samples first.
    """
    device = probs.device
    counts = [seq.num_samples for seq in seqs]
    uniform = torch.rand(sum(counts), device=device)  # global RNG
    start = 0
    for seq, count in zip(seqs, counts, strict=True):
        seed = seq.sampling_params.seed
        if seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(derive_seed(seed, seq.sample_index, seq.context_len))
            uniform[start : start + count] = torch.rand(count, generator=generator, device=device)
        start += count
    cdf = probs.cumsum(dim=-1)  # [num_rows, vocab_size], never decreasing
    if len(uniform) > len(seqs):  # several samples of a row: one cdf row each
        cdf = cdf[torch.repeat_interleave(torch.tensor(counts, device=device))]
    targets = ((1 - uniform) * cdf[:, -1]).unsqueeze(1)  # in (0, total]
    return torch.searchsorted(cdf, targets).squeeze(1)


def derive_seed(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed fixed by the request seed, the sample and the position
    drawn at, stable across processes and machines (unlike ``hash``)."""
    key = f"{seed}:{sample_index}:{position}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _build_outputs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, seqs: list[SeqStep]
) -> list[SeqOutput]:
    """Gather chosen and top-k logprobs on the device, then cross to Python in one go.

    Args:
        logprobs: ``[num_seqs, vocab_size]``.
        token_ids: ``[num_seqs, max_samples]``.
    """
    num_top = min(max(seq.sampling_params.logprobs or 0 for seq in seqs), logprobs.shape[1])
    top = logprobs.topk(num_top, dim=-1)  # values, indices: [num_seqs, num_top]
    chosen = logprobs.gather(1, token_ids).tolist()
    ids, top_values, top_ids = token_ids.tolist(), top.values.tolist(), top.indices.tolist()
    outputs = []
    for i, seq in enumerate(seqs):
        n, k = seq.num_samples, seq.sampling_params.logprobs or 0
        alternatives = dict(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        outputs.append(
            SeqOutput(
                seq_id=seq.seq_id,
                token_ids=ids[i][:n],
                logprobs=chosen[i][:n],
                top_logprobs=[dict(alternatives) for _ in range(n)] if k else [],
            )
        )
    return outputs
