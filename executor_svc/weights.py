"""Loads a checkpoint directory's weights into our paged Llama."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from executor_svc import host_memory
from executor_svc.models.llama import LlamaForCausalLM
from executor_svc.parallel import Shard
from pagedserve.model_files import load_config, weight_files


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """Build the paged model from a checkpoint directory's safetensors files; with a
    ``shard``, only that tensor-parallel rank's slice of it."""
    config = load_config(path)
    if shard is not None:
        config = shard.shard_config(config)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
    files = weight_files(path)
    with tqdm(desc="loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device=str(device)) as f:
                weights = _tracked(f, bar)
                model.load_hf_state_dict(shard.shard_weights(weights) if shard else weights)
    if shard is not None:
        shard.add_all_reduces(model)
    if device.type == "cpu":
        if dtype == torch.float32:
            model.pack_linears(fuse_layers=shard is None)
        host_memory.pack_parameters(model)
    return model.eval()


def _tracked(f, bar: tqdm):
    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
        bar.update()
        yield name, f.get_tensor(name)
