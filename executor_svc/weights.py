"""Loads a checkpoint directory's weights into our paged Llama."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from executor_svc import host_memory
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.parallel import Shard
from pagedserve.model_files import load_config


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """Build the paged model from a checkpoint directory's safetensors files; with a
    ``shard``, only that tensor-parallel rank's slice of it.

    ``dtype`` is the weights'. On a GPU the activations share it; on CPU they are fp32 whatever
    ``dtype`` is: the projections, the logits' weight and the embeddings are packed in ``dtype``
    for the C++ kernels, which widen them to fp32 as they read them; norms and biases stay fp32.
    """
    config = load_config(path)
    if shard is not None:
        config = shard.shard_config(config)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions).to(activation_dtype(dtype, device))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    with tqdm(desc="loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device=str(device)) as f:
                weights = _tracked(f, bar)
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


def _tracked(f, bar: tqdm):
    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
        bar.update()
        yield name, f.get_tensor(name)
