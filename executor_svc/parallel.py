"""Tensor parallelism inside one executor (Megatron-style, the paper's §4.6): the process
group of its ranks and how the Llama weights are split over them.

Rank r of N holds query heads ``[r*H/N, (r+1)*H/N)``, kv heads ``[r*KV/N, (r+1)*KV/N)``
(so grouped-query attention stays within a rank) and MLP columns
``[r*I/N, (r+1)*I/N)``. The output and down projections see only their rank's slice of
the inputs, so their partial outputs are summed over the ranks:

    hidden ─┬─ q/k/v heads of rank 0 ─ attention ─ o_proj cols of rank 0 ─┐
            └─ q/k/v heads of rank 1 ─ attention ─ o_proj cols of rank 1 ─┴─ all-reduce (sum)

Embeddings, norms and the LM head are replicated, so every rank ends with the same
hidden states and logits.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

Weights = Iterable[tuple[str, torch.Tensor]]
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # longest a collective waits for a peer

_SPLIT_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features
_SPLIT_COLUMNS = ("o_proj", "down_proj")  # input features; outputs all-reduced


def check_divisible(config: PretrainedConfig, world_size: int) -> None:
    """Raise ValueError unless ``world_size`` splits the heads, kv heads and MLP evenly."""
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": _num_kv_heads(config),
        "intermediate_size": config.intermediate_size,
    }
    bad = {name: value for name, value in counts.items() if value % world_size}
    if bad:
        found = ", ".join(f"{name} = {value}" for name, value in bad.items())
        raise ValueError(
            f"tensor_parallel_size {world_size} must divide the model's attention heads, "
            f"kv heads and MLP size; not divisible by {world_size}: {found}"
        )


def _num_kv_heads(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@dataclass(frozen=True)
class Shard:
    """One rank's place in the group and the group it sums partial outputs over."""

    rank: int
    world_size: int
    group: dist.ProcessGroup  # a backend object (gloo or NCCL), owned by this Shard

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """Reduce ``tensor`` in place over the ranks (every rank must call it, in order)."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.group.allreduce([tensor], options).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (all must call it)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def shard_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """A copy of ``config`` describing this rank's slice; head_dim made explicit."""
        check_divisible(config, self.world_size)
        sharded = copy.deepcopy(config)
        sharded.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        sharded.num_attention_heads = config.num_attention_heads // self.world_size
        sharded.num_key_value_heads = _num_kv_heads(config) // self.world_size
        sharded.intermediate_size = config.intermediate_size // self.world_size
        return sharded

    def shard_weights(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's slice of each transformers-named weight, as it streams in."""
        for name, tensor in weights:
            parts = name.split(".")
            module = parts[-2] if len(parts) > 1 else ""
            if module in _SPLIT_ROWS:
                tensor = tensor.chunk(self.world_size, dim=0)[self.rank]
            elif module in _SPLIT_COLUMNS and parts[-1] == "weight":
                tensor = tensor.chunk(self.world_size, dim=1)[self.rank]
            elif module in _SPLIT_COLUMNS and self.rank != 0:
                tensor = torch.zeros_like(tensor)  # a bias is added once, not N times
            yield name, tensor

    def add_all_reduces(self, model: nn.Module) -> None:
        """Sum the output and down projections' partial outputs over the ranks."""
        for layer in model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.register_forward_hook(self._sum_output)

    def _sum_output(
        self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor:  # [num_tokens, hidden]
        self.all_reduce(output)
        return output


def join_group(rank: int, world_size: int, store: dist.Store, device: torch.device) -> Shard:
    """Connect this rank to the others (blocks until all have joined): NCCL between GPUs,
    gloo between CPU processes."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
    return Shard(rank, world_size, group)


def pick_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device ``name`` names; under tensor parallelism rank r takes the r-th GPU
    from the named one on."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda" or world_size == 1:
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {world_size} from {device} needs GPU {index}, "
            f"but {torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", index)
