"""Loads a checkpoint directory's weights into our paged Llama."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from executor_svc.models.llama import LlamaForCausalLM
from pagedserve.model_files import load_config


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> LlamaForCausalLM:
    """Build the paged model from a checkpoint directory's safetensors files."""
    config = load_config(path)
    with torch.device(device):
        model = LlamaForCausalLM(config, max_positions).to(dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    with tqdm(desc="loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device=str(device)) as f:
                model.load_hf_state_dict(_tracked(f, bar))
    return model.eval()


def _tracked(f, bar: tqdm):
    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
        bar.update()
        yield name, f.get_tensor(name)
