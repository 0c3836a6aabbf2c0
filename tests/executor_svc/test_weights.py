"""Checkpoints as repositories ship them: sharded safetensors with their index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor_svc.weights import load_model


def loaded(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path, torch.float32, torch.device("cpu")).state_dict()


def test_a_sharded_checkpoint_loads_the_files_its_index_names(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 2
    # The same weights consolidated, as some repositories also ship them (here: wrong ones).
    save_file(
        {"model.embed_tokens.weight": torch.zeros(3, 3)}, sharded / "consolidated.safetensors"
    )
    whole, pieces = loaded(tiny_model_dir), loaded(sharded)
    assert whole.keys() == pieces.keys()
    assert all(torch.equal(whole[name], pieces[name]) for name in whole)


def test_an_index_naming_a_missing_file_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    (sharded / sorted(set(shards.values()))[1]).unlink()
    with pytest.raises(FileNotFoundError, match="not there"):
        loaded(sharded)
