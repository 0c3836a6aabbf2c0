"""The executor core: model, KV pool and sampler behind one ``execute(step)`` call."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import torch

from executor_svc import host_memory, vml
from executor_svc.cache_engine import CacheEngine, CacheShape
from executor_svc.grammar import GrammarMasks
from executor_svc.model_runner import ModelRunner
from executor_svc.parallel import Shard, check_divisible, pick_device
from executor_svc.sampler import Sampler
from executor_svc.weights import activation_dtype, load_model
from executor_svc.workers import WorkerGroup
from pagedserve.architectures import decoder_spec
from pagedserve.model_files import load_config, load_tokenizer, resolve_model
from pagedserve.model_info import ModelInfo
from pagedserve.settings import ExecutorConfig
from pagedserve.step import BlockPairs, ExecuteStep, SeqOutput, SeqStep, StepResult

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Executor:
    """Makes no decisions: applies each step's cache operations, runs the batch, samples.

    With ``tensor_parallel_size`` N > 1 the executor built without a ``shard`` is rank 0:
    it starts ranks 1..N-1 (each an Executor built with its shard), has them apply every
    pool operation it applies, and alone samples. The block ids are the same on all ranks.
    """

    def __init__(self, config: ExecutorConfig, shard: Shard | None = None) -> None:
        self.config = config
        world_size = config.tensor_parallel_size
        self.device = pick_device(config.device, shard.rank if shard else 0, world_size)
        torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
        vml.settle_vml_kernels()  # before the rope tables, the first parallel cos and sin
        self.dtype = _pick_dtype(config.dtype, self.device)  # the weights'
        self.kv_cache_dtype = _DTYPES.get(config.kv_cache_dtype) or activation_dtype(
            self.dtype, self.device
        )
        self.model_path = resolve_model(config.model)
        hf_config = load_config(self.model_path)
        spec = decoder_spec(hf_config)
        self.sliding_window = spec.kv_window
        self.max_model_len = min(config.max_model_len or spec.max_positions, spec.max_positions)
        self.workers: WorkerGroup | None = None
        if shard is None and world_size > 1:
            check_divisible(hf_config, world_size)
            pick_device(config.device, world_size - 1, world_size)  # enough GPUs?
            self.workers = WorkerGroup(Executor, config, self.device)
            shard = self.workers.shard
        self.shard = shard
        self.model = load_model(self.model_path, self.dtype, self.device, self.max_model_len, shard)
        if self.workers is not None:
            self.workers.wait_ready()
        eos = hf_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.cache: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        self.ends = StepEnds()

    def init_cache(self) -> ModelInfo:
        """Allocate the KV pool and the swap pool from the configured budget.

        Under tensor parallelism each rank holds its kv heads of every block, and the
        pools get the fewest blocks any rank can afford, so the block ids agree.
        """
        with self._on_all_ranks("init_cache"):
            info = self._init_cache()
        if self.workers is not None:
            self.workers.wait_done()
        return info

    def _init_cache(self) -> ModelInfo:
        cfg = self.model.config  # this rank's slice: num_key_value_heads / N
        shape = CacheShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=self.model.layers[0].self_attn.head_dim,
            block_size=self.config.block_size,
            dtype=self.kv_cache_dtype,
        )
        num_gpu_blocks = self.config.num_gpu_blocks or shape.num_blocks_for(self._kv_budget())
        num_cpu_blocks = shape.num_blocks_for(int(self.config.swap_space * GiB))
        if self.shard is not None:
            num_gpu_blocks, num_cpu_blocks = self._fewest(num_gpu_blocks, num_cpu_blocks)
        self.cache = CacheEngine(shape, num_gpu_blocks, num_cpu_blocks, self.device)
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()  # after the pools, which keep their own mappings
        rank0 = self.shard is None or self.shard.rank == 0
        sampler = Sampler() if rank0 else _NoSampler()
        grammars = self._grammars() if rank0 else None
        self.runner = ModelRunner(
            self.model, self.cache, sampler, self.device, self.shard, grammars
        )
        return ModelInfo(
            model=self.config.model,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_id=self.eos_token_id,
            block_size=shape.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            sliding_window=self.sliding_window,
        )

    def execute(self, step: ExecuteStep) -> StepResult:
        """Swap out, swap in, copy on write, in that order; then the forward pass. One
        output per sequence in request order, a refused grammar's in its sequence's place."""
        cache, runner = self._pools()
        self.ends.epoch = step.epoch
        order = {seq.seq_id: index for index, seq in enumerate(step.seqs)}  # of the outputs
        refused = self._check_grammars(step)
        if refused:  # the other ranks get the step without them
            step = dataclasses.replace(step, seqs=[s for s in step.seqs if s.seq_id not in refused])
        with self._on_all_ranks("execute", step):
            cache.swap_out(step.blocks_to_swap_out)
            cache.swap_in(step.blocks_to_swap_in)
            cache.copy(step.blocks_to_copy)
            outputs = runner.execute(step.seqs, lambda: self.ends.covers(step))
        self.ends.ran(step)
        outputs += [SeqOutput(seq_id, [], [], error=why) for seq_id, why in refused.items()]
        return StepResult(step.step_id, sorted(outputs, key=lambda o: order[o.seq_id]))

    def _check_grammars(self, step: ExecuteStep) -> dict[int, str]:
        """Why, by seq_id, each sequence whose grammar cannot be used is left out of the
        step (see GrammarMasks.check); decided on rank 0 before any rank touches its pools."""
        grammars = self._pools()[1].grammars
        if self.shard is not None and self.shard.rank > 0:
            return {}  # rank 0 sends the step without them
        if grammars is not None:
            return grammars.check(step.seqs)
        why = f"{self.config.model} has no tokenizer, so no structured outputs"
        return {s.seq_id: why for s in step.seqs if s.sampling_params.grammar is not None}

    def _grammars(self) -> GrammarMasks | None:
        """Structured outputs need the vocabulary's text, so a model without a tokenizer
        (the tests' random ones) has none."""
        tokenizer = load_tokenizer(self.model_path)
        if tokenizer is None or self.eos_token_id is None:
            return None
        return GrammarMasks(tokenizer, self.model.config.vocab_size, self.eos_token_id)

    def end_steps(self, step_id: int, epoch: int | None = None) -> None:
        """Have every step up to ``step_id`` of ``epoch`` (None: the last step's), running
        or queued, stop its decode steps in a row after the current one. Safe from
        another thread while a step runs."""
        self.ends.ask(step_id, epoch)

    def copy_blocks(self, pairs: BlockPairs) -> None:
        """Copy-on-write ``(src, dst)`` pairs in the KV pool outside a step."""
        cache, _ = self._pools()
        with self._on_all_ranks("copy_blocks", pairs):
            cache.copy(pairs)

    def swap_blocks(self, blocks_to_swap_out: BlockPairs, blocks_to_swap_in: BlockPairs) -> None:
        """Swap out, then swap in, outside a step."""
        cache, _ = self._pools()
        with self._on_all_ranks("swap_blocks", blocks_to_swap_out, blocks_to_swap_in):
            cache.swap_out(blocks_to_swap_out)
            cache.swap_in(blocks_to_swap_in)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()

    def _pools(self) -> tuple[CacheEngine, ModelRunner]:
        if self.cache is None or self.runner is None:
            raise RuntimeError("init_cache must run before execute")
        return self.cache, self.runner

    @contextlib.contextmanager
    def _on_all_ranks(self, name: str, *args: object) -> Iterator[None]:
        """On rank 0, send the operation to the other ranks first; if rank 0 then fails,
        the ranks may be stuck in different collectives, which only an exit resolves."""
        if self.workers is None:
            yield
            return
        self.workers.send(name, *args)
        try:
            yield
        except BaseException as e:
            self.workers.fail(f"rank 0 failed in {name}: {type(e).__name__}: {e}")
            raise

    def _fewest(self, num_gpu_blocks: int, num_cpu_blocks: int) -> tuple[int, int]:
        """The smallest pool sizes over the ranks (their free GPU memory may differ)."""
        assert self.shard is not None
        sizes = torch.tensor([num_gpu_blocks, num_cpu_blocks], device=self.device)
        self.shard.all_reduce(sizes, torch.distributed.ReduceOp.MIN)
        return int(sizes[0]), int(sizes[1])

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return GiB


class StepEnds:
    """Which steps stop their decode steps in a row after the current one: every step up
    to a named one of its epoch (a later epoch's are not ended, whatever their ids), until
    a step at or past it has run (a later engine's step ids may start again at 0)."""

    _NONE = (-1, -1)

    def __init__(self) -> None:
        self.epoch = 0  # the last step's: end_steps without an epoch means this one
        self._before = self._NONE  # (epoch, step_id)
        self._lock = threading.Lock()

    def ask(self, step_id: int, epoch: int | None = None) -> None:
        """Two asks may arrive out of order (each its own RPC): the newer step wins."""
        with self._lock:
            self._before = max(self._before, (self.epoch if epoch is None else epoch, step_id))

    def covers(self, step: ExecuteStep) -> bool:
        return (step.epoch, step.step_id) <= self._before

    def ran(self, step: ExecuteStep) -> None:
        with self._lock:
            if (step.epoch, step.step_id) >= self._before:
                self._before = self._NONE


class _NoSampler:
    """Ranks other than 0 compute the same logits but leave the drawing to rank 0."""

    def __call__(self, logits: torch.Tensor, seqs: list[SeqStep]) -> list[SeqOutput]:
        return [SeqOutput(seq.seq_id, [], []) for seq in seqs]


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
