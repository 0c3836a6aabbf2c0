"""What an executor reports of its model, pools and work; shared by both services (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the scheduler needs to know of the model and the pools it may plan over."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    # Positions back from a token that some layer still attends to (the widest window) when
    # every layer slides; 0 when a layer attends to the whole context.
    sliding_window: int = 0
    # Random per executor process start; a new value means the pools were lost.
    # Empty for an in-process executor, which cannot restart under its scheduler.
    instance_id: str = ""


@dataclass(slots=True)
class ExecutorStats:
    """Counters of one executor process since it started, as ``GetStats`` reports them."""

    instance_id: str = ""
    ready: bool = False  # pools allocated (InitCache ran)
    block_size: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_steps: int = 0  # applied; replays not counted
    num_replayed_steps: int = 0
    last_step_id: int | None = None
    epoch: int = 0  # newest scheduler epoch seen
    last_step_seconds: float = 0.0
    total_step_seconds: float = 0.0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_copied: int = 0
    total_overhead_seconds: float = 0.0  # on the executor's thread, around applied steps
    total_read_seconds: float = 0.0  # reading the calls applied, on the event loop
