"""Loads a checkpoint directory's weights into our paged Llama-family decoder."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import PretrainedConfig

from executor_svc import host_memory
from executor_svc.models.gemma3 import Gemma3ForCausalLM
from executor_svc.models.layers import CausalLM
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.parallel import Shard
from pagedserve.architectures import decoder_spec
from pagedserve.model_files import load_config, weight_files

Weights = Iterable[tuple[str, torch.Tensor]]


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    shard: Shard | None = None,
) -> CausalLM:
    """Build the paged model from a checkpoint directory's safetensors files; with a
    ``shard``, only that tensor-parallel rank's slice of it.

    ``dtype`` is the weights'. On a GPU the activations share it; on CPU they are fp32 whatever
    ``dtype`` is: the projections, the logits' weight and the embeddings are packed in ``dtype``
    for the C++ kernels, which widen them to fp32 as they read them; norms and biases stay fp32.
    """
    config = load_config(path)
    fused_checkpoint = decoder_spec(config).fused_checkpoint
    unsharded = config
    if shard is not None:
        config = shard.shard_config(config)
    with torch.device(device):
        model_class = Gemma3ForCausalLM if config.model_type == "gemma3_text" else LlamaForCausalLM
        model = model_class(config, max_positions).to(activation_dtype(dtype, device))
    files = weight_files(path)
    with tqdm(desc="loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device=str(device)) as f:
                weights = _tracked(f, bar)
                if fused_checkpoint:
                    weights = _unfused(weights, unsharded)
                model.load_hf_state_dict(shard.shard_weights(weights) if shard else weights)
    if shard is not None:
        shard.add_all_reduces(model)
    if device.type == "cpu":
        model.pack_linears(dtype, fuse_layers=shard is None)
        host_memory.pack_parameters(model)
    return model.eval()


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model with ``dtype`` weights computes in on ``device`` (see load_model)."""
    return torch.float32 if device.type == "cpu" else dtype


def _unfused(weights: Weights, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused qkv_proj and gate_up_proj as Llama's q/k/v and gate/up projections,
    so that a tensor-parallel shard splits each of them apart."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_size = config.num_key_value_heads * head_dim
    qkv = [config.num_attention_heads * head_dim, kv_size, kv_size]
    gate_up = [config.intermediate_size] * 2
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".qkv_proj"):
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv), strict=True):
                yield f"{prefix.removesuffix('qkv_proj')}{part}.{leaf}", rows
        elif prefix.endswith(".gate_up_proj"):
            for part, rows in zip(("gate_proj", "up_proj"), tensor.split(gate_up), strict=True):
                yield f"{prefix.removesuffix('gate_up_proj')}{part}.{leaf}", rows
        else:
            yield name, tensor


def _tracked(f, bar: tqdm):
    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
        bar.update()
        yield name, f.get_tensor(name)
