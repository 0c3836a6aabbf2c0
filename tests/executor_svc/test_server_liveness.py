"""The executor answers health checks and GetStats while one long step runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep, SeqStep
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorUnavailable
from tests.conftest import save_tiny_llama
from tests.executor_svc.executor_proc import start_executor, stop_executor

BLOCK_SIZE = 16
PROMPT_LEN = 2000  # a prefill that outlasts many polls
NUM_GPU_BLOCKS = -(-PROMPT_LEN // BLOCK_SIZE)
POLL_TIMEOUT_S = 1.0
POLL_PAUSE_S = 0.01  # leaves the cores to the step

Answer = tuple[float, float]  # (sent, answered), time.monotonic()


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, wider and deeper, with room for the long prompt."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("wide-llama"),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def _long_prefill() -> ExecuteStep:
    prompt = [3 + i % 500 for i in range(PROMPT_LEN)]
    table = list(range(NUM_GPU_BLOCKS))
    seq = SeqStep(0, prompt, 0, table, SamplingParams(temperature=0.0))
    return ExecuteStep(step_id=1, epoch=1, seqs=[seq])


def _timed_execute(client: ExecutorClient, step: ExecuteStep) -> tuple[float, float]:
    start = time.monotonic()
    client.execute(step)
    return start, time.monotonic()


def _poll_until_done(client: ExecutorClient, done: Callable[[], bool]) -> list[Answer]:
    """Health, then GetStats, over and over until ``done()``; each pair that answered
    within the client's deadline, with when it was sent and when both had answered."""
    answers = []
    while not done():
        sent = time.monotonic()
        try:
            assert client.health() == "SERVING"
            client.get_stats()
        except ExecutorUnavailable:
            continue
        answers.append((sent, time.monotonic()))
        time.sleep(POLL_PAUSE_S)
    return answers


def test_health_and_stats_answer_while_a_long_step_runs(
    wide_model_dir: Path, tmp_path: Path
) -> None:
    server = start_executor(wide_model_dir, tmp_path / "executor.log", NUM_GPU_BLOCKS)
    try:
        server.client.init_cache()
        server.client.wait_ready(timeout=30)
        poller = ExecutorClient(server.client.address, call_timeout=POLL_TIMEOUT_S)
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(_timed_execute, server.client, _long_prefill())
            answers = _poll_until_done(poller, step.done)
            start, end = step.result()
        poller.close()
    finally:
        stop_executor(server)
    # Only the middle half of the step counts: its first and last moments run Python
    # around the kernels, where the loop gets its turn even while the kernels hold the GIL.
    quarter = (end - start) / 4
    inside = [a for a in answers if start + quarter <= a[0] and a[1] <= end - quarter]
    assert len(inside) >= 2, f"step took {end - start:.2f} s; answers {answers}"
