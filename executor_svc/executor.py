"""The executor core: model, KV pool and sampler behind one ``execute(step)`` call."""

from __future__ import annotations

import torch

from executor_svc.cache_engine import CacheEngine, CacheShape
from executor_svc.model_runner import ModelRunner
from executor_svc.sampler import Sampler
from executor_svc.weights import load_model
from pagedserve.model_files import load_config, resolve_model
from pagedserve.model_info import ModelInfo
from pagedserve.settings import ExecutorConfig
from pagedserve.step import ExecuteStep, StepResult

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Executor:
    """Makes no decisions: applies each step's cache operations, runs the batch, samples."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.device = _pick_device(config.device)
        torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
        self.dtype = _pick_dtype(config.dtype, self.device)
        self.model_path = resolve_model(config.model)
        hf_config = load_config(self.model_path)
        self.max_model_len = min(
            config.max_model_len or hf_config.max_position_embeddings,
            hf_config.max_position_embeddings,
        )
        self.model = load_model(self.model_path, self.dtype, self.device, self.max_model_len)
        eos = hf_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.cache: CacheEngine | None = None
        self.runner: ModelRunner | None = None

    def init_cache(self) -> ModelInfo:
        """Allocate the KV pool and the swap pool from the configured budget."""
        cfg = self.model.config
        shape = CacheShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=self.model.layers[0].self_attn.head_dim,
            block_size=self.config.block_size,
            dtype=self.dtype,
        )
        num_gpu_blocks = self.config.num_gpu_blocks or shape.num_blocks_for(self._kv_budget())
        num_cpu_blocks = shape.num_blocks_for(int(self.config.swap_space * GiB))
        self.cache = CacheEngine(shape, num_gpu_blocks, num_cpu_blocks, self.device)
        self.runner = ModelRunner(self.model, self.cache, Sampler(), self.device)
        return ModelInfo(
            model=self.config.model,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            block_size=shape.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
        )

    def execute(self, step: ExecuteStep) -> StepResult:
        """Swap out, swap in, copy on write, in that order; then the forward pass."""
        if self.cache is None or self.runner is None:
            raise RuntimeError("init_cache must run before execute")
        self.cache.swap_out(step.blocks_to_swap_out)
        self.cache.swap_in(step.blocks_to_swap_in)
        self.cache.copy(step.blocks_to_copy)
        return StepResult(step.step_id, self.runner.execute(step.seqs))

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return GiB


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
