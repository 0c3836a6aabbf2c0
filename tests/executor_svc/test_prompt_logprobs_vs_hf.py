"""Prompt logprobs equal a transformers forward pass over the prompt: computed in chunks,
beside prefix-cached requests, through preemptions, and with nothing generated."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineOptions, ExecutorConfig, PreemptionMode
from pagedserve.step import PromptLogprob
from tests.executor_svc.test_generation_vs_hf import LENGTHS, SENTENCES, make_prompts

TOLERANCE = 1e-4  # fp32 rounding between our kernels and transformers'
TOP = 3


@functools.cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[PromptLogprob]:
    """Tokens 1.. of the prompt as transformers scores them: one forward pass."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(TOP, dim=-1)
    return [
        PromptLogprob(lp, rank, dict(zip(ids, values, strict=True)))
        for lp, rank, ids, values in zip(
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top.indices.tolist(),
            top.values.tolist(),
            strict=True,
        )
    ]


def assert_same_scores(ours: list[PromptLogprob], theirs: list[PromptLogprob]) -> None:
    assert len(ours) == len(theirs), "every prompt token after the first, once"
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        assert a.logprob == pytest.approx(b.logprob, abs=TOLERANCE), f"token {position}"
        assert a.top_logprobs.keys() == b.top_logprobs.keys() or _near_tie(b), position
        for token_id, value in a.top_logprobs.items():
            assert value == pytest.approx(b.top_logprobs.get(token_id, value), abs=TOLERANCE)
        assert a.rank == b.rank, f"token {position}: rank"


def _near_tie(scored: PromptLogprob) -> bool:
    values = sorted(scored.top_logprobs.values(), reverse=True)
    return any(x - y < TOLERANCE for x, y in itertools.pairwise(values))


def run(model_dir: Path, prompts: list[list[int]], params: SamplingParams, **options):
    llm = OfflineLLM(
        ExecutorConfig(model=str(model_dir), **options.pop("executor", {})),
        EngineOptions(**options),
    )
    requests = [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    return llm.generate(requests, progress=False), llm


SCORED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)


CHUNKS = {"max_num_batched_tokens": 64}


@pytest.mark.parametrize(
    "setting",
    [
        {"max_num_batched_tokens": 4096},
        CHUNKS,
        CHUNKS
        | {
            "executor": {"num_gpu_blocks": 100, "swap_space": 0.05},
            "preemption_mode": PreemptionMode.RECOMPUTE,
        },
    ],
    ids=["whole", "chunks", "recompute"],
)
def test_tiny_prompt_logprobs_match_hf(tiny_model_dir: Path, setting: dict) -> None:
    """Whole prompts in one step (their scored rows sliced across sequences), or every
    prompt past 64 tokens over several steps: each position is scored once, also when a
    preempted prompt is computed again."""
    prompts = make_prompts(512, LENGTHS, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, prompt_logprobs=TOP)
    results, llm = run(tiny_model_dir, prompts, params, **setting)
    stats = llm.engine.stats
    assert (stats.num_prompt_chunks > 0) == (setting["max_num_batched_tokens"] == 64)
    if "preemption_mode" in setting:
        assert stats.preemptions.get("recompute", 0) > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert_same_scores(result.prompt_logprobs, hf_prompt_logprobs(tiny_model_dir, prompt))
        assert len(result.outputs[0].token_ids) == 64


def test_tiny_prompt_logprobs_with_prefix_caching(tiny_model_dir: Path) -> None:
    """A prompt to score takes no cached block (no logits there), yet publishes its own;
    a later request that scores nothing still reuses them."""
    system = make_prompts(512, [48], seed=7)[0]
    prompts = make_prompts(512, [5, 17, 30], seed=3, prefix=system)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = OfflineLLM(
        ExecutorConfig(model=str(tiny_model_dir)),
        EngineOptions(enable_prefix_caching=True, max_num_seqs=1, max_num_batched_tokens=20),
    )
    counters = llm.engine.scheduler.block_manager.counters
    llm.generate([Request("warm", prompt_token_ids=prompts[0], params=plain)], progress=False)
    hits = counters.prefix_cache_hits
    requests = [Request(str(i), prompt_token_ids=p, params=SCORED) for i, p in enumerate(prompts)]
    results = llm.generate(requests, progress=False)
    assert counters.prefix_cache_hits == hits, "a prompt to score took cached blocks"
    for prompt, result in zip(prompts, results, strict=True):
        assert_same_scores(result.prompt_logprobs, hf_prompt_logprobs(tiny_model_dir, prompt))
    llm.generate([Request("after", prompt_token_ids=prompts[2], params=plain)], progress=False)
    assert counters.prefix_cache_hits >= hits + 48


def test_max_tokens_zero_scores_the_prompt_and_draws_nothing(tiny_model_dir: Path) -> None:
    prompt = make_prompts(512, [40], seed=5)[0]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=0, prompt_logprobs=0)
    (result,), llm = run(tiny_model_dir, [prompt], params, max_num_batched_tokens=16)
    assert [c.token_ids for c in result.outputs] == [[], []]
    assert [c.finish_reason for c in result.outputs] == ["length", "length"]
    reference = hf_prompt_logprobs(tiny_model_dir, prompt)
    assert [p.top_logprobs for p in result.prompt_logprobs] == [{}] * (len(prompt) - 1)
    for ours, theirs in zip(result.prompt_logprobs, reference, strict=True):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=TOLERANCE)
    assert llm.engine.scheduler.block_manager.gpu.num_free_blocks == llm.info.num_gpu_blocks


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.slow
def test_smollm2_prompt_logprobs_match_hf(smollm2_dir: Path) -> None:
    """The real model: a prompt past a 128-token budget, in chunks, with prefix caching on
    and its first blocks already cached by an earlier request."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(smollm2_dir).encode(SENTENCES * 4)[:300]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm = OfflineLLM(
        ExecutorConfig(model=str(smollm2_dir), num_gpu_blocks=128),
        EngineOptions(enable_prefix_caching=True, max_num_batched_tokens=128),
    )
    llm.generate([Request("warm", prompt_token_ids=prompt[:200], params=plain)], progress=False)
    (result,) = llm.generate([Request("scored", prompt_token_ids=prompt, params=SCORED)], False)
    assert llm.engine.stats.num_prompt_chunks >= 2
    assert_same_scores(result.prompt_logprobs, hf_prompt_logprobs(smollm2_dir, prompt))
