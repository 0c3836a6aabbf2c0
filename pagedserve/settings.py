"""Configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field


class PreemptionMode(enum.Enum):
    """How a group is evicted when decode slots run out (the paper's §4.5)."""

    SWAP = "swap"
    RECOMPUTE = "recompute"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache as the block manager sees it."""

    block_size: int = field(default=16, metadata=_help("tokens per KV block (8-128)"))
    num_gpu_blocks: int = field(default=4096, metadata=_help("blocks in the executor's KV pool"))
    num_cpu_blocks: int = field(default=1024, metadata=_help("blocks in the CPU swap pool"))
    watermark: float = field(
        default=0.01, metadata=_help("fraction of the KV pool kept free at admission")
    )
    enable_prefix_caching: bool = field(
        default=False, metadata=_help("reuse computed blocks of identical prompt prefixes")
    )

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.num_gpu_blocks < 1 or self.num_cpu_blocks < 0:
            raise ValueError("num_gpu_blocks must be >= 1 and num_cpu_blocks >= 0")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


# A server's decode_steps_quiet_s: requests arriving every second or two (light online
# traffic) keep each call to one step. At alpaca's rates of 0.5-2 requests/s, 8 steps a call
# raised the time to first token from 0.03-0.06 s (p50) to 0.04-0.15 s.
SERVING_DECODE_STEPS_QUIET_S = 2.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one engine step and the preemption policy."""

    max_num_seqs: int = field(default=256, metadata=_help("sequences running at once"))
    max_num_batched_tokens: int = field(
        default=4096, metadata=_help("tokens computed in one step (prefill + decode)")
    )
    max_model_len: int = field(default=2048, metadata=_help("prompt + output tokens per sequence"))
    preemption_mode: PreemptionMode | None = field(
        default=None,
        metadata=_help("swap or recompute; default: recompute single sequences, swap groups"),
    )
    num_decode_steps: int = field(
        default=8,
        metadata=_help(
            "decode steps an executor runs in a row when only decodes are scheduled and "
            "nothing waits (one scheduler round trip and commit for all of them)"
        ),
    )
    decode_steps_quiet_s: float = field(
        default=0.0,
        metadata=_help(
            "seconds without a new request before decode steps run in a row: while requests "
            "keep arriving each call is one step, so a newcomer waits one step, not several"
        ),
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps must be >= 1, got {self.num_decode_steps}")
        if not self.decode_steps_quiet_s >= 0:  # also refuses NaN
            raise ValueError(f"decode_steps_quiet_s must be >= 0, got {self.decode_steps_quiet_s}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or a long prompt could never run"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    """The model and the memory the executor gives its KV pool and swap pool."""

    model: str = field(
        default="SmolLM2-135M-Instruct",
        metadata=_help("default model name, Hugging Face checkpoint directory or .gguf file"),
    )
    dtype: str = field(default="auto", metadata=_help("auto, float32, float16 or bfloat16"))
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda[:N]"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block (8-128)"))
    num_gpu_blocks: int | None = field(
        default=None, metadata=_help("KV pool size in blocks (overrides kv_cache_memory)")
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=_help(
            "KV pool size in bytes (per rank); default 1 GiB on CPU, 90% of free GPU memory"
        ),
    )
    swap_space: float = field(default=1.0, metadata=_help("CPU swap pool in GiB (per rank)"))
    max_model_len: int | None = field(
        default=None, metadata=_help("longest sequence; default: the model's own limit")
    )
    seed: int = field(default=0, metadata=_help("seed of unseeded sampling"))
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("worker processes (one per GPU) splitting heads and MLP columns"),
    )

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16; got {self.dtype}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP front door: address, authentication and the limits checked per request."""

    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=8000, metadata=_help("HTTP port"))
    api_key: str | None = field(
        default=None,
        metadata=_help("when set, every route but /health and the /dashboard page requires it"),
    )
    max_n: int = field(default=16, metadata=_help("largest n (and best_of) accepted"))
    max_logprobs: int = field(default=20, metadata=_help("largest logprobs accepted"))
    max_body_bytes: int = field(default=4 << 20, metadata=_help("largest request body"))
    executor_budget_s: float = field(
        default=30.0,
        metadata=_help("refuse new requests (503) once the executor is away this long"),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_n < 1 or self.max_logprobs < 0 or self.max_body_bytes < 1:
            raise ValueError("max_n >= 1, max_logprobs >= 0 and max_body_bytes >= 1 required")


def crash_point() -> tuple[str, int] | None:
    """``PAGEDSERVE_CRASH_AT=where:step`` (tests only): kill -9 the scheduler at a step
    boundary — ``before_persist``, ``after_persist`` or ``after_execute`` of step N."""
    value = os.environ.get("PAGEDSERVE_CRASH_AT")
    if not value:
        return None
    where, _, step = value.partition(":")
    if where not in ("before_persist", "after_persist", "after_execute") or not step.isdigit():
        raise ValueError(f"PAGEDSERVE_CRASH_AT must be WHERE:STEP, got {value!r}")
    return where, int(step)
