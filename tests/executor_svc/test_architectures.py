"""Each supported architecture's greedy output equals transformers' token for token, and its
logprobs to fp32 rounding, on a tiny random checkpoint built from that family's config; the
rest is refused naming the config field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.architectures import decoder_spec
from pagedserve.settings import PreemptionMode
from tests.executor_svc.test_decoder_layers import generate
from tests.executor_svc.test_generation_vs_hf import hf_greedy, make_prompts, run_ours

VOCAB = 512
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": None,
    "pad_token_id": 0,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LONGROPE = {  # head_dim 16: 8 factors each
    "rope_type": "longrope",
    "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0],
    "long_factor": [2.0] * 8,
}
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
# (config class, its overrides): every architecture and option the README's table lists
CASES = {
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", {}),
    "llama-rope-llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-linear": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
    ),
    "llama-rope-dynamic": (
        "LlamaConfig",
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
            "max_position_embeddings": 512,
        },
    ),
    "llama-rope-yarn": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "phi3": ("Phi3Config", {}),
    "phi3-longrope": (
        "Phi3Config",
        {"rope_parameters": LONGROPE, "original_max_position_embeddings": 256},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "num_hidden_layers": 3,
            "sliding_window": 24,
            "layer_types": GEMMA3_LAYERS,
            "final_logit_softcapping": 30.0,
        },
    ),
    "mistral-sliding-window": ("MistralConfig", {"sliding_window": 24, "head_dim": 16}),
    "qwen2-sliding-window": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
    ),
}


def save_tiny(path: Path, config_class: str, overrides: dict) -> Path:
    """A seeded random checkpoint of that family; biases and norm weights drawn too (they
    start at 0 and 1), so that a missing or misplaced one changes the output."""
    import transformers

    config = getattr(transformers, config_class)(**(SHAPE | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return path


def assert_same_greedy_and_logprobs(ours, theirs) -> None:
    """Tokens equal (at a near-tie both in each other's top 5, then stop); the chosen token's
    logprob equal to fp32 rounding at every step before."""
    for index, (completion, (hf_tokens, hf_tops)) in enumerate(zip(ours, theirs, strict=True)):
        tokens, tops = completion.outputs[0].token_ids, completion.outputs[0].top_logprobs
        assert len(tokens) == len(hf_tokens), f"prompt {index}: length differs"
        for step, (a, b) in enumerate(zip(tokens, hf_tokens, strict=True)):
            if a != b:
                assert a in hf_tops[step] and b in tops[step], (
                    f"prompt {index} step {step}: ours {a}, transformers {b}"
                )
                break
            assert tops[step][a] == pytest.approx(hf_tops[step][a], abs=2e-4), (
                f"prompt {index} step {step}: logprob of {a}"
            )


# A shared 48-token prefix (prefix caching takes its blocks), prompts past the windows.
PROMPTS = make_prompts(VOCAB, [5, 30], seed=3, prefix=make_prompts(VOCAB, [48], seed=7)[0])
PROMPTS += make_prompts(VOCAB, [77, 130], seed=4)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_dir = save_tiny(tmp_path_factory.mktemp(request.param), *CASES[request.param])
    return model_dir, hf_greedy(model_dir, PROMPTS, 64)


def test_greedy_matches_hf(case) -> None:
    model_dir, reference = case
    ours, llm = run_ours(model_dir, PROMPTS, block_size=8)
    assert llm.engine.scheduler.block_manager.counters.prefix_cache_hits > 0
    llm.close()
    assert_same_greedy_and_logprobs(ours, reference)


def test_greedy_matches_hf_in_chunks_under_preemption(case) -> None:
    from transformers import AutoConfig

    model_dir, reference = case
    # Where every layer slides a sequence holds about a window's blocks: a smaller pool.
    sliding = decoder_spec(AutoConfig.from_pretrained(model_dir)).kv_window > 0
    ours, llm = run_ours(
        model_dir,
        PROMPTS,
        num_gpu_blocks=9 if sliding else 20,
        swap_space=0.05,
        preemption_mode=PreemptionMode.RECOMPUTE,
        max_num_batched_tokens=32,
    )
    assert sum(llm.engine.stats.preemptions.values()) > 0
    llm.close()
    assert_same_greedy_and_logprobs(ours, reference)


# What the one-call C++ decoder takes beyond plain Llama: o_proj's bias, q/k norms, windows.
FUSED_CASES = ("llama-biases", "qwen3", "mistral-sliding-window", "qwen2-sliding-window")


@pytest.mark.parametrize("name", FUSED_CASES)
def test_fused_layers_equal_the_modules(name: str, tmp_path: Path) -> None:
    """The one-call C++ decoder and the per-module path give the same bits."""
    model_dir = save_tiny(tmp_path, *CASES[name])
    assert generate(model_dir, fused=True) == generate(model_dir, fused=False)


@pytest.mark.parametrize(
    ("config_class", "overrides", "message"),
    [
        ("GemmaConfig", {}, "model_type 'gemma'"),
        ("Gemma3TextConfig", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        (
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "nonsense", "factor": 2.0}},
            "rope_parameters.rope_type 'nonsense'",
        ),
        ("Phi3Config", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(config_class, overrides, message):
    import transformers

    config = getattr(transformers, config_class)(**(SHAPE | overrides))
    with pytest.raises(ValueError, match=message):
        decoder_spec(config)


@pytest.mark.parametrize(
    ("name", "window"),
    [
        ("mistral-sliding-window", 24),
        ("qwen2-sliding-window", 0),  # layer 0 below max_window_layers attends to everything
        ("gemma3", 0),  # global layers
        ("qwen2", 0),
    ],
)
def test_blocks_are_freed_outside_the_window_only_when_every_layer_slides(name, window) -> None:
    import transformers

    config_class, overrides = CASES[name]
    config = getattr(transformers, config_class)(**(SHAPE | overrides))
    assert decoder_spec(config).kv_window == window


def test_longrope_is_served_up_to_its_original_length() -> None:
    import transformers

    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 256,
    }
    overrides = {"rope_parameters": rope, "original_max_position_embeddings": 256}
    config = transformers.Phi3Config(**(SHAPE | overrides))
    assert decoder_spec(config).max_positions == 256
