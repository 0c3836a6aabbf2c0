"""The executor service as a real process over loopback gRPC, driven by ExecutorClient."""

from __future__ import annotations

import dataclasses
import itertools
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, ExecutorConfig, SchedulerConfig
from pagedserve.step import ExecuteStep, SeqStep
from scheduler_svc.engine import LLMEngine, StepExecutor
from scheduler_svc.executor_client import ExecutorClient, ExecutorUnavailable, StepRefused

NUM_GPU_BLOCKS = 64
SWAP_GIB = 0.01
START_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    client: ExecutorClient
    log_path: Path
    epochs: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))

    def next_epoch(self) -> int:
        """Each test acts as a new scheduler: a newer epoch, step ids from anywhere."""
        return next(self.epochs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir: Path, log_path: Path) -> Server:
    """Start an executor process and wait until its health service answers; a port taken
    between choosing and binding it is retried."""
    for _ in range(3):
        server = _try_start(model_dir, log_path, _free_port())
        if server is not None:
            return server
    pytest.fail(f"no free port after 3 tries:\n{log_path.read_text()}")


def _try_start(model_dir: Path, log_path: Path, port: int) -> Server | None:
    cmd = [sys.executable, "-m", "pagedserve.cli", "executor", "--port", str(port)]
    cmd += ["--model", str(model_dir), "--num-gpu-blocks", str(NUM_GPU_BLOCKS)]
    cmd += ["--swap-space", str(SWAP_GIB), "--device", "cpu"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, ExecutorClient(f"127.0.0.1:{port}", execute_timeout=30), log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if "cannot listen" in log_path.read_text():
                return None
            pytest.fail(f"executor exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            server.client.health(timeout=1.0)
            return server
        except ExecutorUnavailable:
            time.sleep(0.1)
    _stop(server)
    pytest.fail(f"executor did not answer in {START_TIMEOUT_S} s:\n{log_path.read_text()}")


def _stop(server: Server) -> None:
    server.client.close()
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One executor for the module, pools allocated and SERVING; killed at the end."""
    server = _start(tiny_model_dir, tmp_path_factory.mktemp("executor") / "executor.log")
    try:
        server.client.init_cache()
        server.client.wait_ready(timeout=30)
        yield server
    finally:
        _stop(server)


def _step(step_id: int, epoch: int, **seq_fields: object) -> ExecuteStep:
    """One prefill of 3 tokens into block 0, sampled at temperature 1 (a rerun would
    almost surely draw differently), with ``seq_fields`` overriding the sequence."""
    fields = dict(
        seq_id=0,
        new_token_ids=[5, 6, 7],
        num_computed_tokens=0,
        block_table=[0],
        sampling_params=SamplingParams(temperature=1.0, logprobs=3),
        num_samples=4,
    )
    fields.update(seq_fields)
    return ExecuteStep(step_id, epoch, [SeqStep(**fields)])


def _generate(executor: StepExecutor, info: ModelInfo, epoch: int) -> list:
    """Greedy and seeded parallel-sampling requests (forks, copy-on-write) to the end."""
    cache = CacheConfig(
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        num_cpu_blocks=info.num_cpu_blocks,
    )
    sched = SchedulerConfig(max_model_len=info.max_model_len, max_num_batched_tokens=4096)
    engine = LLMEngine(executor, cache, sched, info.eos_token_id)
    engine.epoch = epoch
    rng = random.Random(0)
    prompts = [[rng.randrange(3, info.vocab_size) for _ in range(n)] for n in (5, 17, 33, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    groups = [
        engine.add_request(str(i), prompt, greedy if i % 2 else sampled, arrival_time=i)
        for i, prompt in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    return [
        [(s.output_token_ids, s.cumulative_logprob, s.output_top_logprobs) for s in g.outputs()]
        for g in groups
    ]


def test_health_init_cache_and_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = _start(tiny_model_dir, tmp_path / "executor.log")
    try:
        client = server.client
        assert client.health() == "NOT_SERVING"
        with pytest.raises(StepRefused) as refused:
            client.execute(_step(0, 0))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        info = client.init_cache()
        client.wait_ready(timeout=10)
        assert client.health() == "SERVING"
        assert (info.num_gpu_blocks, info.vocab_size, info.block_size) == (64, 512, 16)
        assert info.num_cpu_blocks > 0 and info.instance_id
        assert client.init_cache() == info  # a repeat keeps the pools
        client.execute(_step(0, 0))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=10) == 0, server.log_path.read_text()
    finally:
        _stop(server)


def test_engine_over_grpc_matches_in_process(server: Server, tiny_model_dir: Path) -> None:
    from executor_svc.executor import Executor

    info = server.client.init_cache()
    before = server.client.get_stats()
    remote = _generate(server.client, info, server.next_epoch())
    assert server.client.get_stats().num_blocks_copied > before.num_blocks_copied  # CoW ran
    config = ExecutorConfig(
        model=str(tiny_model_dir), device="cpu", num_gpu_blocks=NUM_GPU_BLOCKS, swap_space=SWAP_GIB
    )
    local_executor = Executor(config)
    local_info = local_executor.init_cache()
    assert dataclasses.replace(local_info, instance_id=info.instance_id) == info
    local = _generate(local_executor, local_info, epoch=0)
    for got, want in zip(remote, local, strict=True):
        assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert remote[1][0][2] and len(remote[1][0][2]) == 24  # top logprobs travelled


def test_replay_is_answered_from_the_stored_result(server: Server) -> None:
    client = server.client
    epoch = server.next_epoch()
    step = _step(10, epoch)
    first = client.execute(step)
    before = client.get_stats()
    assert client.execute(step) == first
    # A restarted scheduler (newer epoch) replaying its pending step gets the lost result,
    # and the step becomes the newer epoch's last: an older id is out of order there.
    newer = server.next_epoch()
    assert client.execute(dataclasses.replace(step, epoch=newer)) == first
    with pytest.raises(StepRefused, match="out of order"):
        client.execute(_step(9, newer))
    after = client.get_stats()
    assert after.num_steps == before.num_steps and after.last_step_id == 10
    assert after.num_replayed_steps == before.num_replayed_steps + 2
    assert client.execute(_step(11, after.epoch)) != first  # the next step is applied
    assert client.get_stats().num_steps == before.num_steps + 1


@pytest.mark.parametrize(
    ("step_id", "epoch_delta", "why"),
    [(12, -1, "older than the newest"), (4, 0, "out of order"), (5, 0, "different content")],
)
def test_stale_steps_are_refused(server: Server, step_id: int, epoch_delta: int, why: str) -> None:
    client = server.client
    epoch = server.next_epoch()
    client.execute(_step(5, epoch))
    before = client.get_stats()
    stale = _step(step_id, epoch + epoch_delta, new_token_ids=[9, 9])
    with pytest.raises(StepRefused, match=why) as refused:
        client.execute(stale)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.get_stats() == before


MAX_LEN = 1024  # the tiny model's max_position_embeddings


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"block_table": [NUM_GPU_BLOCKS]}, "seqs[0].block_table[0]"),
        ({"block_table": [-1]}, "seqs[0].block_table[0]"),
        ({"new_token_ids": [5, 512]}, "seqs[0].new_token_ids[1]"),
        ({"new_token_ids": [-3]}, "seqs[0].new_token_ids[0]"),
        ({"num_computed_tokens": -1}, "seqs[0].num_computed_tokens"),
        ({"new_token_ids": list(range(20))}, "seqs[0].block_table"),
        ({"num_computed_tokens": MAX_LEN - 1, "block_table": [0] * 65}, "max_model_len"),
        ({"num_samples": 0}, "seqs[0].num_samples"),
        ({"num_steps": 2}, "seqs[0].num_steps"),  # steps in a row of four samples each
        ({"num_samples": 1, "num_steps": 15}, "seqs[0].block_table"),  # 17 positions
        (
            {"num_samples": 1, "num_steps": 3, "num_computed_tokens": MAX_LEN - 4},
            "max_model_len",
        ),
        ({"blocks_to_copy": [(0, NUM_GPU_BLOCKS)]}, "blocks_to_copy[0].dst"),
        ({"blocks_to_swap_in": [(10**6, 0)]}, "blocks_to_swap_in[0].src"),
    ],
)
def test_invalid_steps_are_refused(server: Server, overrides: dict, field: str) -> None:
    client = server.client
    epoch = server.next_epoch()
    step_fields = {k: overrides.pop(k) for k in list(overrides) if k.startswith("blocks_")}
    bad = dataclasses.replace(_step(0, epoch, **overrides), **step_fields)
    bad.blocks_to_swap_out = bad.blocks_to_swap_out or [(1, 0)]  # valid: must not run
    before = client.get_stats()
    with pytest.raises(StepRefused) as refused:
        client.execute(bad)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.message
    assert client.get_stats() == dataclasses.replace(before, epoch=epoch)  # pools untouched
    assert len(client.execute(_step(0, epoch, seq_id=epoch)).outputs[0].token_ids) == 4
    assert client.get_stats().num_steps == before.num_steps + 1  # applied, not a replay


def test_copy_and_swap_blocks_count(server: Server) -> None:
    client = server.client
    before = client.get_stats()
    assert client.copy_blocks([(1, 2), (3, 4)]) == 2
    assert client.swap_blocks([(2, 0), (4, 1)], [(0, 5)]) == (2, 1)
    after = client.get_stats()
    assert after.num_blocks_copied == before.num_blocks_copied + 2
    assert after.num_blocks_swapped_out == before.num_blocks_swapped_out + 2
    assert after.num_blocks_swapped_in == before.num_blocks_swapped_in + 1
    with pytest.raises(StepRefused, match=r"blocks_to_swap_in\[0\].dst"):
        client.swap_blocks([], [(0, NUM_GPU_BLOCKS)])
    assert client.get_stats() == after
