"""A stand-in executor for bench/control_plane.py: the real gRPC server, step ledger, step
checks, cache operations and decode steps in a row, with a forward pass that only sleeps a
fixed time and draws deterministic tokens. It stands for an accelerator fast enough that
everything around the forward pass decides how busy it stays.

    python -m bench.standin_executor --port 50051 --step-ms 5 --num-gpu-blocks 8192
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence

import torch

from executor_svc.cache_engine import CacheEngine, CacheShape
from executor_svc.executor import Executor, StepEnds
from executor_svc.model_runner import ModelRunner
from executor_svc.server import serve
from pagedserve.flags import add_flags, from_args
from pagedserve.log import configure_logging
from pagedserve.model_files import load_config, resolve_model
from pagedserve.model_info import ModelInfo
from pagedserve.settings import ExecutorConfig
from pagedserve.step import SeqOutput, SeqStep

# Drawn tokens cycle through ordinary vocabulary entries: no special token, no EOS.
FIRST_TOKEN, NUM_TOKENS = 1000, 5000


def standin_token(seq_id: int, position: int) -> int:
    """The token a sequence draws at ``position``: fixed by both, whatever the batch."""
    return FIRST_TOKEN + (seq_id * 31 + position) % NUM_TOKENS


class SleepingRunner(ModelRunner):
    """ModelRunner's decode loop (steps in a row, ending early) over a forward pass that
    sleeps ``step_s`` and draws ``standin_token``s."""

    def __init__(self, step_s: float) -> None:  # no model, pools or sampler to hold
        self.step_s = step_s
        self.shard = None
        self.grammars = None  # a structured output is refused, as by a model without text

    def _forward(self, seqs: list[SeqStep]) -> list[SeqOutput]:
        if not seqs:
            return []
        time.sleep(self.step_s)
        outputs = []
        for seq in seqs:
            token_id = standin_token(seq.seq_id, seq.context_len)
            n = seq.num_samples
            outputs.append(SeqOutput(seq.seq_id, [token_id] * n, [0.0] * n))
        return outputs


class StandInExecutor(Executor):
    """Executor with SleepingRunner for a model: pools of one float per slot (the cache
    operations are real, on tiny tensors), the model's vocabulary and limits from its
    config alone, so the scheduler detokenizes real text."""

    def __init__(self, config: ExecutorConfig, step_s: float) -> None:  # loads no weights
        self.config, self.step_s = config, step_s
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.hf_config = load_config(resolve_model(config.model))
        limit = self.hf_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        eos = self.hf_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.workers, self.shard = None, None
        self.cache: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        self.ends = StepEnds()

    def _init_cache(self) -> ModelInfo:
        shape = CacheShape(1, 1, 1, self.config.block_size, self.dtype)
        num_gpu_blocks = self.config.num_gpu_blocks or 8192
        self.cache = CacheEngine(shape, num_gpu_blocks, num_gpu_blocks // 4, self.device)
        self.runner = SleepingRunner(self.step_s)
        return ModelInfo(
            model=self.config.model,
            vocab_size=self.hf_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            block_size=shape.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_gpu_blocks // 4,
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--step-ms", type=float, default=5.0, help="time one forward pass takes")
    add_flags(p, ExecutorConfig)
    args = p.parse_args(argv)
    configure_logging()
    make = functools.partial(StandInExecutor, step_s=args.step_ms / 1000)
    return serve(from_args(ExecutorConfig, args), args.host, args.port, None, 0, make)


if __name__ == "__main__":
    sys.exit(main())
