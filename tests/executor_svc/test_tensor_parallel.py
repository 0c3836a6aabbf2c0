"""Tensor parallelism on CPU (gloo): an executor split over 2 ranks draws the tokens one
rank draws, through forks, copy-on-write and swapping, and no rank outlives a failure."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.cli import main
from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, PreemptionMode, SchedulerConfig
from scheduler_svc.engine.engine import LLMEngine, StepExecutor
from scheduler_svc.engine.executor_client import ExecutorClient
from tests.services import free_port, start

NUM_GPU_BLOCKS = 12  # small enough that the requests below must swap a group out
SWAP_GIB = 0.01
START_TIMEOUT_S = 240.0  # two processes import torch on a busy machine


@dataclasses.dataclass
class TPServer:
    proc: subprocess.Popen
    client: ExecutorClient
    epochs: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    def log(self) -> str:
        return self.proc.log_path.read_text()

    def workers(self) -> list[int]:
        """The worker pids rank 0 logged when it started them."""
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "executor.workers_started":
                    return record["pids"]
        raise AssertionError(f"no workers_started in the log:\n{self.log()}")


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _config(model_dir: Path, tensor_parallel_size: int) -> ExecutorConfig:
    return ExecutorConfig(
        model=str(model_dir),
        device="cpu",
        num_gpu_blocks=NUM_GPU_BLOCKS,
        swap_space=SWAP_GIB,
        tensor_parallel_size=tensor_parallel_size,
    )


@contextlib.contextmanager
def _serve_tp(model_dir: Path) -> Iterator[TPServer]:
    """`pagedserve executor --tensor-parallel-size 2` in its own process group."""
    port = free_port()
    args = ["executor", "--port", str(port), "--metrics-port", "0", "--model", str(model_dir)]
    args += ["--device", "cpu", "--num-gpu-blocks", str(NUM_GPU_BLOCKS)]
    args += ["--swap-space", str(SWAP_GIB), "--tensor-parallel-size", "2"]
    proc = start(args, f"pagedserve-tp-{port}.log")
    client = None
    try:
        # Dial only once it listens: a channel refused early backs off for seconds.
        deadline = time.monotonic() + START_TIMEOUT_S
        while "executor.listening" not in (log := proc.log_path.read_text()):
            assert proc.poll() is None, f"executor exited {proc.returncode}:\n{log}"
            assert time.monotonic() < deadline, f"not listening in time:\n{log}"
            time.sleep(0.2)
        # A first step may compile the CPU kernels: a generous deadline on a busy machine.
        client = ExecutorClient(f"127.0.0.1:{port}", execute_timeout=300)
        client.health(timeout=30.0)
        yield TPServer(proc, client)
    finally:
        if client is not None:
            client.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir: Path) -> Iterator[TPServer]:
    with _serve_tp(tiny_model_dir) as server:
        server.client.init_cache()
        server.client.wait_ready(timeout=30)
        yield server


def _generate(executor: StepExecutor, info: ModelInfo, epoch: int) -> list[list[list[int]]]:
    """Greedy, seeded parallel sampling and beam search in a pool too small for all of
    them at once: forks, copy-on-write and swap preemption. Returns each output's tokens."""
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(
        max_model_len=info.max_model_len,
        max_num_batched_tokens=4096,
        preemption_mode=PreemptionMode.SWAP,
    )
    engine = LLMEngine(executor, cache, sched, info.eos_token_id)
    engine.epoch = epoch
    rng = random.Random(0)
    prompts = [[rng.randrange(3, info.vocab_size) for _ in range(n)] for n in (33, 40, 17, 20)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    groups = [
        engine.add_request(str(i), prompt, p, arrival_time=i)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    return [[list(s.output_token_ids) for s in g.outputs()] for g in groups]


def test_two_ranks_draw_what_one_rank_draws(tp_server: TPServer, tiny_model_dir: Path) -> None:
    from executor_svc.executor import Executor

    client = tp_server.client
    info = client.init_cache()
    assert (info.num_gpu_blocks, info.vocab_size) == (NUM_GPU_BLOCKS, 512)
    before = client.get_stats()
    got = _generate(client, info, next(tp_server.epochs))
    after = client.get_stats()
    assert after.num_blocks_copied > before.num_blocks_copied  # copy-on-write ran
    assert after.num_blocks_swapped_out > before.num_blocks_swapped_out  # a group was swapped
    assert after.num_blocks_swapped_in > before.num_blocks_swapped_in
    local = Executor(_config(tiny_model_dir, 1))
    local_info = local.init_cache()
    # The swap space is per rank, and a rank's block holds half the kv heads.
    assert info.num_cpu_blocks // 2 == local_info.num_cpu_blocks
    same = dataclasses.replace(info, instance_id="", num_cpu_blocks=local_info.num_cpu_blocks)
    assert same == dataclasses.replace(local_info, instance_id="")
    assert got == _generate(local, local_info, epoch=0)
    assert [len(outputs) for outputs in got] == [1, 2, 1, 2]


def test_copy_and_swap_blocks_outside_a_step(tp_server: TPServer) -> None:
    client = tp_server.client
    assert client.copy_blocks([(1, 2)]) == 1
    assert client.swap_blocks([(2, 0)], [(0, 3)]) == (1, 1)
    assert [_running(pid) for pid in tp_server.workers()] == [True]  # applied them too


def test_sigterm_to_the_process_group_stops_every_rank(tp_server: TPServer) -> None:
    """The last test of the shared server (file order): it stops it."""
    workers = tp_server.workers()
    os.killpg(tp_server.proc.pid, signal.SIGTERM)  # as Ctrl-C or `kill -- -PGID` would
    assert tp_server.proc.wait(timeout=60) == 0, tp_server.log()
    assert _wait_gone(workers) == []
    assert "executor.workers_stopped" in tp_server.log()


def test_a_dead_worker_takes_the_executor_down(tiny_model_dir: Path) -> None:
    with _serve_tp(tiny_model_dir) as server:
        (worker,) = server.workers()
        os.kill(worker, signal.SIGKILL)
        assert server.proc.wait(timeout=30) != 0
        assert "executor.tensor_parallel_failed" in server.log()


def test_no_worker_outlives_a_killed_rank_0(tiny_model_dir: Path) -> None:
    with _serve_tp(tiny_model_dir) as server:
        server.client.init_cache()
        workers = server.workers()
        assert [_running(pid) for pid in workers] == [True]
        server.proc.kill()  # only rank 0: the worker is left to notice
        server.proc.wait()
        assert _wait_gone(workers) == []


def test_offline_generate_with_two_ranks(tiny_model_dir: Path) -> None:
    from pagedserve.offline import OfflineLLM, Request

    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    requests = [Request("0", prompt_token_ids=[5, 6, 7, 8, 9], params=params)]
    tokens = {}
    for size in (1, 2):
        llm = OfflineLLM(_config(tiny_model_dir, size))
        try:
            (result,) = llm.generate(requests, progress=False)
        finally:
            llm.close()
        tokens[size] = [c.token_ids for c in result.outputs]
        if size == 2:
            assert llm.executor.workers is not None
            assert [p.exitcode for p in llm.executor.workers.procs] == [0]
    assert tokens[1] == tokens[2]


@pytest.mark.parametrize(
    ("size", "why"),
    [
        (3, "not divisible by 3: num_attention_heads = 4, num_key_value_heads = 2"),
        (0, "tensor_parallel_size must be >= 1, got 0"),
    ],
)
def test_a_size_that_does_not_split_the_model_is_refused(
    size: int, why: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--prompt", "hi", "--model", str(tiny_model_dir), "--device", "cpu"]
    assert main([*args, "--tensor-parallel-size", str(size)]) == 2
    assert why in capsys.readouterr().err
