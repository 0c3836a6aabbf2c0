"""Sampler behaviour: greedy, beam, truncation, temperature, seeds, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from executor_svc import sampler as sampler_module
from executor_svc.sampler import Sampler, derive_seed
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SeqStep

VOCAB = 32


def make_seq(seq_id: int = 0, num_samples: int = 1, context_len: int = 5, **params) -> SeqStep:
    return SeqStep(
        seq_id=seq_id,
        new_token_ids=[1] * context_len,
        num_computed_tokens=0,
        block_table=[0],
        sampling_params=SamplingParams(**params),
        num_samples=num_samples,
    )


def random_logits(num_seqs: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_seqs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def one_hot_logits(values: list[float]) -> torch.Tensor:
    return torch.tensor([values])


def test_greedy_is_argmax_and_logprob_is_log_softmax() -> None:
    logits = random_logits(4)
    outs = Sampler()(logits, [make_seq(i, temperature=0.0) for i in range(4)])
    expected = logits.argmax(dim=-1).tolist()
    assert [o.token_ids for o in outs] == [[t] for t in expected]
    log_softmax = torch.log_softmax(logits, dim=-1)
    for i, out in enumerate(outs):
        assert out.seq_id == i
        assert out.logprobs[0] == pytest.approx(log_softmax[i, expected[i]].item(), abs=1e-5)
        assert out.top_logprobs == []


def test_a_greedy_row_draws_the_same_alone_as_beside_other_rows() -> None:
    # Alone, plain greedy rows take the fused pass; beside a sampled, a penalized and a
    # logprobs row, the general one.
    logits = random_logits(4, vocab=1000)
    greedy = [make_seq(i, temperature=0.0) for i in range(4)]
    alone = Sampler()(logits, greedy)
    others = [
        make_seq(4, temperature=1.0, seed=1),
        make_seq(5, temperature=0.0, presence_penalty=1.0),
        make_seq(6, temperature=0.0, logprobs=2),
    ]
    mixed = Sampler()(torch.cat([logits, random_logits(3, seed=1, vocab=1000)]), greedy + others)
    for one, other in zip(alone, mixed[:4], strict=True):
        assert one.token_ids == other.token_ids
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-5)


def test_a_near_tie_that_log_softmax_rounds_away_keeps_its_greedy_token() -> None:
    # The two logits are one ulp apart, which log_softmax's rounding erases: both paths take
    # the logits' argmax, so the company in the batch cannot change the token.
    low = torch.tensor(0.01)
    logits = torch.tensor([[low.item(), torch.nextafter(low, torch.tensor(1.0)).item(), -3.0]])
    log_softmax = torch.log_softmax(logits, dim=-1)
    assert log_softmax[0, 0] == log_softmax[0, 1]  # the tie this test is about
    (alone,) = Sampler()(logits, [make_seq(0, temperature=0.0)])
    beside = [make_seq(0, temperature=0.0), make_seq(1, temperature=0.0, logprobs=1)]
    mixed = Sampler()(torch.cat([logits, logits]), beside)
    assert alone.token_ids == mixed[0].token_ids == [1]


def test_greedy_with_several_samples_repeats_argmax() -> None:
    logits = random_logits(1)
    (out,) = Sampler()(logits, [make_seq(num_samples=3, temperature=0.0)])
    assert out.token_ids == [logits.argmax().item()] * 3
    assert len(out.logprobs) == 3


def test_beam_returns_sorted_top_tokens() -> None:
    logits = random_logits(2)
    seqs = [
        make_seq(0, num_samples=4, temperature=0.0, use_beam_search=True, n=4),
        make_seq(1, num_samples=2, temperature=0.0, use_beam_search=True, n=2),
    ]
    outs = Sampler()(logits, seqs)
    for i, (out, k) in enumerate(zip(outs, [4, 2], strict=True)):
        top = torch.log_softmax(logits[i], dim=-1).topk(k)
        assert out.token_ids == top.indices.tolist()
        assert out.logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
        assert out.logprobs == sorted(out.logprobs, reverse=True)


def test_beam_wider_than_vocab_is_refused() -> None:
    seq = make_seq(num_samples=VOCAB + 1, temperature=0.0, use_beam_search=True)
    with pytest.raises(ValueError, match="beams"):
        Sampler()(random_logits(1), [seq])


def test_rows_must_match_seqs() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(random_logits(2), [make_seq()])


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}])
def test_extreme_truncation_equals_greedy(params: dict) -> None:
    logits = random_logits(6, seed=1)
    seqs = [make_seq(i, num_samples=20, temperature=1.5, **params) for i in range(6)]
    outs = Sampler()(logits, seqs)
    assert [o.token_ids for o in outs] == [[t] * 20 for t in logits.argmax(dim=-1).tolist()]


def drawn_tokens(logits: torch.Tensor, num_samples: int = 4000, **params) -> set[int]:
    (out,) = Sampler()(logits, [make_seq(num_samples=num_samples, seed=7, **params)])
    return set(out.token_ids)


def test_min_p_never_draws_tokens_below_threshold() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.09, 0.06, 0.05])  # keep >= 0.2 * 0.40
    assert drawn_tokens(probs.log().unsqueeze(0), min_p=0.2) == {0, 1, 2, 3}


def test_top_k_keeps_k_most_likely() -> None:
    probs = torch.tensor([0.10, 0.30, 0.05, 0.25, 0.20, 0.10])
    assert drawn_tokens(probs.log().unsqueeze(0), top_k=3) == {1, 3, 4}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.10, 0.50, 0.05, 0.30, 0.05])
    assert drawn_tokens(probs.log().unsqueeze(0), top_p=0.6) == {1, 3}
    assert drawn_tokens(probs.log().unsqueeze(0), top_p=0.85) == {0, 1, 3}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_draws_follow_tempered_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    num_samples = 20000
    seq = make_seq(num_samples=num_samples, temperature=temperature, seed=3)
    (out,) = Sampler()(logits, [seq])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).float()
    expected = torch.softmax(logits[0] / temperature, dim=-1) * num_samples
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 5 degrees of freedom, p ~ 0.001


@pytest.mark.parametrize("truncation", [{"top_p": 0.95}, {}], ids=["top_p", "none"])
def test_seeded_draws_ignore_batch_composition_and_row_order(truncation: dict) -> None:
    """Beside rows that truncate and rows that do not, greedy rows and other seeds."""
    target_logits = random_logits(1, seed=5, vocab=64)[0]
    target = dict(temperature=1.0, seed=1234, **truncation)
    (alone,) = Sampler()(target_logits.unsqueeze(0), [make_seq(9, num_samples=8, **target)])

    others = random_logits(3, seed=6, vocab=64)
    logits = torch.stack([others[0], others[1], target_logits, others[2]])
    seqs = [
        make_seq(0, num_samples=3, temperature=0.8, top_k=5),
        make_seq(1, temperature=0.0, logprobs=2),
        make_seq(9, num_samples=8, **target),
        make_seq(3, num_samples=2, temperature=1.2, seed=99, min_p=0.1),
    ]
    torch.manual_seed(0)
    batched = Sampler()(logits, seqs)[2]
    torch.manual_seed(1)
    again = Sampler()(logits.flip(0), seqs[::-1])[1]
    assert batched.token_ids == alone.token_ids == again.token_ids
    assert len(set(alone.token_ids)) > 1


def test_different_seed_sample_or_position_draws_differently() -> None:
    logits = torch.zeros(1, 1000)  # uniform: 8 equal draws by chance ~ 1e-24

    def tokens(seed: int, sample_index: int = 0, context_len: int = 5) -> list[int]:
        seq = make_seq(num_samples=8, seed=seed, context_len=context_len)
        seq.sample_index = sample_index
        return Sampler()(logits, [seq])[0].token_ids

    base = tokens(1)
    assert tokens(1) == base
    assert tokens(2) != base
    assert tokens(1, sample_index=1) != base
    assert tokens(1, context_len=6) != base


def test_derive_seed_is_stable() -> None:
    # Fixed values: a seed drawn from hash() or a per-process salt would change them.
    assert (derive_seed(1, 0, 5), derive_seed(-3, 2, 10**9)) == (
        9004308050778634062,
        536730974163978169,
    )
    assert len({derive_seed(1, 0, 5), derive_seed(1, 1, 5), derive_seed(1, 0, 6)}) == 3
    assert 0 <= derive_seed(-3, 2, 10**9) < 2**63


def penalized_argmax(logits: torch.Tensor, prompt: list[int], output: list[int], **params) -> int:
    seq = make_seq(temperature=0.0, **params)
    seq.prompt_token_ids, seq.output_token_ids = prompt, output
    return Sampler()(logits, [seq])[0].token_ids[0]


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = one_hot_logits([2.0, 1.9, 0.5, -0.1])
    assert penalized_argmax(logits, [], []) == 0
    assert penalized_argmax(logits, [0], [], repetition_penalty=1.5) == 1  # 2 / 1.5
    assert penalized_argmax(logits, [], [0], repetition_penalty=1.5) == 1
    negative = one_hot_logits([-1.0, -1.2, -3.0])
    assert penalized_argmax(negative, [0], [], repetition_penalty=1.5) == 1  # -1 * 1.5
    assert penalized_argmax(negative, [0], [], repetition_penalty=0.5) == 0


def test_presence_penalty_counts_output_once() -> None:
    logits = one_hot_logits([2.0, 1.5, 0.0])
    assert penalized_argmax(logits, [0], [], presence_penalty=1.0) == 0  # prompt is exempt
    assert penalized_argmax(logits, [], [0], presence_penalty=1.0) == 1
    assert penalized_argmax(logits, [], [0, 0, 0], presence_penalty=0.4) == 0  # once: 1.6
    assert penalized_argmax(logits, [], [1], presence_penalty=-1.0) == 1  # negative rewards


def test_frequency_penalty_scales_with_count() -> None:
    logits = one_hot_logits([2.0, 1.5, 0.0])
    assert penalized_argmax(logits, [], [0], frequency_penalty=0.2) == 0  # 1.8
    assert penalized_argmax(logits, [], [0, 0, 0], frequency_penalty=0.2) == 1  # 1.4


def test_penalties_shape_logprobs_and_leave_input_alone() -> None:
    logits = random_logits(2)
    original = logits.clone()
    seq = make_seq(1, temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.3)
    seq.prompt_token_ids, seq.output_token_ids = [3, 4], [4, 4, 7]
    out = Sampler()(logits, [make_seq(0, temperature=0.0), seq])[1]
    expected = logits[1].clone()
    for token in (3, 4, 7):
        value = expected[token]
        expected[token] = value / 1.3 if value > 0 else value * 1.3
    expected[4] -= 1.0
    expected[7] -= 0.5
    assert out.token_ids == [expected.argmax().item()]
    log_softmax = torch.log_softmax(expected, dim=-1)
    assert out.logprobs[0] == pytest.approx(log_softmax[out.token_ids[0]].item(), abs=1e-5)
    assert torch.equal(logits, original)


def test_logprobs_are_tempered_log_softmax_before_truncation() -> None:
    logits = random_logits(3, seed=2)
    seqs = [make_seq(i, num_samples=5, temperature=0.5 + i, top_k=4, seed=i) for i in range(3)]
    outs = Sampler()(logits, seqs)
    for i, out in enumerate(outs):
        log_softmax = torch.log_softmax(logits[i] / (0.5 + i), dim=-1)
        assert len(out.token_ids) == len(out.logprobs) == 5
        expected = [log_softmax[t].item() for t in out.token_ids]
        assert out.logprobs == pytest.approx(expected, abs=1e-5)


def test_top_logprobs_hold_k_alternatives_per_draw() -> None:
    logits = random_logits(3, seed=4)
    seqs = [
        make_seq(0, num_samples=3, logprobs=4, seed=1),
        make_seq(1, temperature=0.0, logprobs=1),
        make_seq(2, num_samples=2, logprobs=0, seed=2),
    ]
    outs = Sampler()(logits, seqs)
    top4 = torch.log_softmax(logits[0], dim=-1).topk(4)
    assert len(outs[0].top_logprobs) == 3
    for alternatives in outs[0].top_logprobs:
        assert list(alternatives) == top4.indices.tolist()
        assert list(alternatives.values()) == pytest.approx(top4.values.tolist(), abs=1e-5)
    (greedy_top,) = outs[1].top_logprobs
    assert list(greedy_top) == outs[1].token_ids
    assert greedy_top[outs[1].token_ids[0]] == pytest.approx(outs[1].logprobs[0])
    assert outs[2].top_logprobs == []


def test_mixed_batch_returns_each_rows_sample_count() -> None:
    seqs = [
        make_seq(0, num_samples=1),
        make_seq(1, num_samples=6, temperature=0.9, top_k=10),
        make_seq(2, num_samples=3, temperature=0.0, use_beam_search=True, n=3),
        make_seq(3, num_samples=2, temperature=0.0),
    ]
    outs = Sampler()(random_logits(4, seed=8), seqs)
    assert [len(o.token_ids) for o in outs] == [1, 6, 3, 2]
    assert [len(o.logprobs) for o in outs] == [1, 6, 3, 2]
    assert all(0 <= t < VOCAB for o in outs for t in o.token_ids)
    assert Sampler()(torch.empty(0, VOCAB), []) == []


def sorted_reference(
    logprobs: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept, then min-p, by sorting the whole row."""
    sorted_logprobs, order = logprobs.sort(descending=True)
    k = top_k if top_k > 0 else len(logprobs)
    sorted_probs = sorted_logprobs[:k].softmax(dim=-1)
    kept = int(((sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p).sum()) if top_p < 1 else k
    keep = torch.zeros_like(logprobs, dtype=torch.bool)
    keep[order[: max(kept, 1)]] = True
    probs = logprobs.exp()
    keep &= probs >= min_p * probs.max()
    return logprobs.masked_fill(~keep, float("-inf")).softmax(dim=-1)


TRUNCATIONS = {
    "peaked top_p": (8.0, {"top_p": 0.9}),  # nucleus well inside the candidates
    "flat top_p": (0.05, {"top_p": 0.9}),  # nucleus reaching past them: a full sort
    "top_k within": (1.0, {"top_k": 5, "top_p": 0.8}),
    "top_k past": (0.05, {"top_k": 3000, "top_p": 0.5}),
    "min_p only": (1.0, {"min_p": 0.3}),
}


def test_partial_sort_truncates_as_a_full_sort_does() -> None:
    vocab = 4 * sampler_module.NUM_CANDIDATES
    rows = [
        scale * random_logits(1, seed=i, vocab=vocab)
        for i, (scale, _) in enumerate(TRUNCATIONS.values())
    ]
    logprobs = torch.cat(rows).log_softmax(dim=-1)
    params = [SamplingParams(**p) for _, p in TRUNCATIONS.values()]
    probs = sampler_module._truncated_probs(logprobs, params)
    for row, p in enumerate(params):
        expected = sorted_reference(logprobs[row], p.top_k, p.top_p, p.min_p)
        assert torch.equal(probs[row] > 0, expected > 0), list(TRUNCATIONS)[row]
        torch.testing.assert_close(probs[row], expected)
    alone = [
        sampler_module._truncated_probs(logprobs[i : i + 1], [p]) for i, p in enumerate(params)
    ]
    assert torch.equal(torch.cat(alone), probs)  # a row's path ignores its neighbours
