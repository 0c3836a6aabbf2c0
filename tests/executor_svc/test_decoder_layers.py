"""The decoder layers in one C++ call (fp32 CPU) compute exactly what the modules compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import EngineOptions, ExecutorConfig
from tests.conftest import save_tiny_llama


def generate(model_dir: Path, fused: bool) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Prompts admitted while others decode, so steps mix prefill and decode tokens."""
    config = ExecutorConfig(model=str(model_dir), max_model_len=256)
    llm = OfflineLLM(config, EngineOptions(max_num_batched_tokens=256))
    model = llm.executor.model
    if not fused:
        model._fused_layers = None
    assert (model._fused_layers is not None) == fused
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 130, 17, 220, 64)]
    requests = [Request(str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    completions = llm.generate(requests, progress=False)
    llm.close()
    return [(c.outputs[0].token_ids, c.outputs[0].top_logprobs) for c in completions]


@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MLP biases, which the C++ layers take as optional arguments (drawn at random:
    transformers initialises them to zero), and a tied embedding."""
    from transformers import LlamaForCausalLM

    path = save_tiny_llama(
        tmp_path_factory.mktemp("tiny-biased"),
        mlp_bias=True,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.data.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model", ["tiny_model_dir", "biased_model_dir"])
def test_fused_layers_give_the_modules_bits(model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    fused, modules = generate(model_dir, fused=True), generate(model_dir, fused=False)
    assert fused == modules
