"""A sliding-window model whose prompts and outputs run far past its window: blocks wholly
before the window go back to the pool as it generates, each sequence holds a bounded
number, and greedy tokens and logprobs still equal transformers' (prefix caching on, prompts
in chunks, swap and recompute preemption)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedserve.offline import OfflineLLM
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineOptions, ExecutorConfig, PreemptionMode
from pagedserve.step import NO_BLOCK
from scheduler_svc.core.sequence import Sequence
from tests.executor_svc.test_architectures import CASES, VOCAB, save_tiny
from tests.executor_svc.test_generation_vs_hf import hf_greedy, make_prompts

WINDOW = 24  # CASES["mistral-sliding-window"]
BLOCK_SIZE = 8
BUDGET = 32  # tokens a step: prompts go in chunks
NEW_TOKENS = 200
# A shared 48-token prefix (prefix caching takes its blocks); prompt + output 10-20 windows.
PROMPTS = make_prompts(VOCAB, [150, 280], seed=5, prefix=make_prompts(VOCAB, [48], seed=8)[0])
PROMPTS += make_prompts(VOCAB, [230], seed=6) + make_prompts(VOCAB, [40], seed=7)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = save_tiny(tmp_path_factory.mktemp("mistral"), *CASES["mistral-sliding-window"])
    return model_dir, hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def generate(model_dir: Path, **options: object) -> tuple[list[Sequence], int, OfflineLLM]:
    """Greedy generation step by step, checking the tables after each; returns the first
    sequence of each request, the most blocks one table held, and the LLM."""
    num_gpu_blocks = options.pop("num_gpu_blocks", None)
    executor = ExecutorConfig(
        model=str(model_dir), block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, swap_space=0.05
    )
    engine = EngineOptions(max_num_batched_tokens=BUDGET, decode_steps_quiet_s=0.0, **options)
    llm = OfflineLLM(executor, engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    groups = [
        llm.engine.add_request(str(i), prompt, params, arrival_time=i)
        for i, prompt in enumerate(PROMPTS)
    ]
    bm = llm.engine.scheduler.block_manager
    most_held = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        bm.check_integrity()
        held = [sum(b != NO_BLOCK for b in table) for table in bm.block_tables.values()]
        most_held = max([most_held, *held])
    return [group.seqs[0] for group in groups], most_held, llm


def assert_equal_to_hf(seqs: list[Sequence], reference: list) -> None:
    """Tokens equal (at a near-tie both in each other's top 5, then stop); the chosen
    token's logprob equal to fp32 rounding at every step before."""
    for index, (seq, (hf_tokens, hf_tops)) in enumerate(zip(seqs, reference, strict=True)):
        tokens, tops = seq.output_token_ids, seq.output_top_logprobs
        assert len(tokens) == len(hf_tokens) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(tokens, hf_tokens, strict=True)):
            if a != b:
                assert a in hf_tops[step] and b in tops[step], f"prompt {index} step {step}"
                break
            assert tops[step][a] == pytest.approx(hf_tops[step][a], abs=2e-4), (
                f"prompt {index} step {step}: logprob of {a}"
            )


def test_blocks_outside_the_window_are_freed_and_generation_matches_hf(mistral) -> None:
    model_dir, reference = mistral
    seqs, most_held, llm = generate(model_dir)
    bm = llm.engine.scheduler.block_manager
    assert bm.sliding_window == WINDOW
    assert bm.counters.window_freed_blocks > 0 and bm.counters.prefix_cache_hits > 0
    # A chunk of BUDGET queries reaches WINDOW - 1 positions back: that span, plus a block
    # for the boundaries, against ~60 blocks a whole sequence takes.
    assert most_held <= math.ceil((WINDOW - 1 + BUDGET) / BLOCK_SIZE) + 1
    llm.close()
    assert_equal_to_hf(seqs, reference)


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_generation_matches_hf_under_preemption(mistral, mode: PreemptionMode) -> None:
    model_dir, reference = mistral
    # 16 blocks: decoding groups are swapped out, prompts part-way through recomputed.
    seqs, _, llm = generate(model_dir, num_gpu_blocks=16, preemption_mode=mode)
    assert llm.engine.stats.preemptions.get(mode.value, 0) > 0
    assert llm.engine.scheduler.block_manager.counters.window_freed_blocks > 0
    llm.close()
    assert_equal_to_hf(seqs, reference)


def test_without_freeing_every_block_stays_held(mistral) -> None:
    """The same run with freeing off holds every position's block: what it saves."""
    model_dir, reference = mistral
    seqs, most_held, llm = generate(model_dir, free_outside_window=False)
    assert llm.engine.scheduler.block_manager.counters.window_freed_blocks == 0
    assert most_held == math.ceil((len(PROMPTS[1]) + NEW_TOKENS) / BLOCK_SIZE)
    llm.close()
    assert_equal_to_hf(seqs, reference)
