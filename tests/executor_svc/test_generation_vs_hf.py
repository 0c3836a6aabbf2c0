"""Greedy and beam-search generation equal Hugging Face transformers', token for token.

Where fp32 rounding makes a near-tie the rule is vLLM's: at the first difference, each
side's token must be among the other side's top-5 alternatives.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineOptions, ExecutorConfig, PreemptionMode

NEW_TOKENS = 64


def make_prompts(vocab: int, lengths: list[int], seed: int = 0, prefix: list[int] = ()) -> list:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_new: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[tuple]:
    """Each prompt alone (no padding): generated tokens and per-step top-5 logprobs.

    As ``ignore_eos`` generates: an end-of-sequence token is drawn like any other and does
    not stop (transformers' ``min_new_tokens`` would forbid drawing it instead)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=max_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        tops = []
        for scores in out.scores:
            logprobs = torch.log_softmax(scores[0].float(), -1)
            values, ids = logprobs.topk(5)
            tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
        results.append((tokens, tops))
    return results


def assert_same_greedy(ours, theirs) -> None:
    for index, (completion, (hf_tokens, hf_tops)) in enumerate(zip(ours, theirs, strict=True)):
        tokens = completion.outputs[0].token_ids
        tops = completion.outputs[0].top_logprobs
        assert len(tokens) == len(hf_tokens), f"prompt {index}: length differs"
        for step, (a, b) in enumerate(zip(tokens, hf_tokens, strict=True)):
            if a != b:  # a near-tie: both choices must be top-5 on both sides
                assert a in hf_tops[step] and b in tops[step], (
                    f"prompt {index} step {step}: ours {a}, transformers {b}"
                )
                break


def run_ours(model_dir: Path, prompts: list[list[int]], **kwargs) -> list:
    engine = EngineOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_ARGS})
    llm = OfflineLLM(ExecutorConfig(model=str(model_dir), **kwargs), engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    requests = [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    return llm.generate(requests, progress=False), llm


_ENGINE_ARGS = {
    "preemption_mode",
    "enable_prefix_caching",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
}
LENGTHS = [16, 23, 40, 77, 130, 201, 350, 500]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    prompts = make_prompts(512, LENGTHS)
    return prompts, hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_tiny_greedy_matches_hf(tiny_model_dir, tiny_reference, block_size):
    prompts, reference = tiny_reference
    ours, _ = run_ours(tiny_model_dir, prompts, block_size=block_size)
    assert_same_greedy(ours, reference)


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_tiny_greedy_matches_hf_under_preemption(tiny_model_dir, tiny_reference, mode):
    prompts, reference = tiny_reference
    # 100 blocks of 16 hold the longest request but not all eight at once.
    ours, llm = run_ours(
        tiny_model_dir, prompts, num_gpu_blocks=100, swap_space=0.05, preemption_mode=mode
    )
    assert llm.engine.stats.preemptions.get(mode.value, 0) > 0
    assert_same_greedy(ours, reference)


def test_tiny_greedy_matches_hf_with_mixed_prefill_and_decode_steps(tiny_model_dir, tiny_reference):
    prompts, reference = tiny_reference
    ours, llm = run_ours(tiny_model_dir, prompts, max_num_batched_tokens=1024)
    assert llm.engine.stats.num_mixed_steps > 0
    assert_same_greedy(ours, reference)


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"num_gpu_blocks": 100, "swap_space": 0.05, "preemption_mode": PreemptionMode.RECOMPUTE},
        {"num_gpu_blocks": 100, "swap_space": 0.05, "preemption_mode": PreemptionMode.SWAP},
    ],
    ids=["roomy", "recompute", "swap"],
)
def test_tiny_greedy_matches_hf_with_prompts_in_chunks(tiny_model_dir, tiny_reference, setting):
    """A 64-token budget splits every prompt past 64 tokens over several steps, each chunk
    attending to the earlier ones through the cache, decodes batched beside them."""
    prompts, reference = tiny_reference
    ours, llm = run_ours(tiny_model_dir, prompts, max_num_batched_tokens=64, **setting)
    stats = llm.engine.stats
    assert stats.num_prompt_chunks >= sum(-(-n // 64) - 1 for n in LENGTHS)
    if "preemption_mode" in setting:
        assert sum(stats.preemptions.values()) > 0
    assert_same_greedy(ours, reference)


@pytest.mark.parametrize("chunked", [False, True])
def test_tiny_greedy_matches_hf_with_prefix_caching(tiny_model_dir, chunked):
    system = make_prompts(512, [48], seed=7)[0]
    prompts = make_prompts(512, [5, 17, 30, 9], seed=3, prefix=system)
    reference = hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)
    ours, llm = run_ours(
        tiny_model_dir,
        prompts,
        enable_prefix_caching=True,
        max_num_seqs=1,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=20 if chunked else None,
    )
    assert llm.engine.scheduler.block_manager.counters.prefix_cache_hits >= 3 * 48
    assert_same_greedy(ours, reference)


def hf_beam(model_dir: Path, prompt: list[int], width: int, max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        num_beams=width,
        do_sample=False,
        length_penalty=1.0,
        early_stopping=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_tiny_beam_search_matches_hf(tiny_model_dir):
    prompts = make_prompts(512, [12, 60], seed=5)
    llm = OfflineLLM(ExecutorConfig(model=str(tiny_model_dir)))
    params = SamplingParams(
        n=1, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=24, ignore_eos=True
    )
    ours = llm.generate(
        [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)],
        progress=False,
    )
    for prompt, result in zip(prompts, ours, strict=True):
        assert result.outputs[0].token_ids == hf_beam(tiny_model_dir, prompt, 4, 24)
    assert llm.engine.scheduler.block_manager.counters.cow_copies > 0


def test_parallel_sampling_with_a_seed_is_reproducible(tiny_model_dir):
    prompt = make_prompts(512, [20], seed=9)[0]
    params = SamplingParams(
        n=4, temperature=0.8, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True
    )
    runs = []
    for other in (0, 3):  # different company in the batch must not change the draws
        llm = OfflineLLM(ExecutorConfig(model=str(tiny_model_dir), seed=other))
        batch = [Request("seeded", prompt_token_ids=prompt, params=params)] + [
            Request(
                f"noise{i}",
                prompt_token_ids=make_prompts(512, [7 + i], seed=i)[0],
                params=SamplingParams(max_tokens=16, temperature=1.0),
            )
            for i in range(other)
        ]
        runs.append([c.token_ids for c in llm.generate(batch, progress=False)[0].outputs])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 4 and len({tuple(t) for t in runs[0]}) > 1


SENTENCES = (
    "The committee met on a grey morning to weigh the harbour plans. "
    "Engineers argued that the old sea wall would not survive another decade of storms. "
    "A fisherman asked who would pay for the dredging, and nobody answered at first. "
    "By noon the mayor had promised a public hearing and a written report. "
)


def text_prompts(model_dir: Path) -> list[list[int]]:
    """Real text, one prompt of each of LENGTHS tokens (each starting a token later)."""
    from transformers import AutoTokenizer

    text_ids = AutoTokenizer.from_pretrained(model_dir).encode(SENTENCES * 40)
    return [text_ids[i : i + n] for i, n in enumerate(LENGTHS)]


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_dir):
    prompts = text_prompts(smollm2_dir)
    reference = hf_greedy(smollm2_dir, prompts, NEW_TOKENS)
    ours, _ = run_ours(smollm2_dir, prompts, num_gpu_blocks=512)
    assert_same_greedy(ours, reference)
