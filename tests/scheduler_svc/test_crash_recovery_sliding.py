"""kill -9 of the scheduler serving a sliding-window model, after blocks outside the window
went back to the pool: the restart reads the tables with their freed entries from Redis,
replays the step in flight, and every request ends as an uninterrupted run does."""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import uuid
from pathlib import Path

import httpx
import pytest

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ExecutorConfig
from tests.executor_svc.test_architectures import CASES, save_tiny
from tests.scheduler_svc.test_crash_recovery import PROMPTS, body, scheduler, used_blocks
from tests.services import free_port, start, stop

pytestmark = pytest.mark.redis
MAX_TOKENS = 48
# About 60 tokens each: from the first decode step on, each table frees its first blocks.
LONG_PROMPTS = [
    f"{p}, then {' and '.join(PROMPTS)}, twice: {' and '.join(PROMPTS)}" for p in PROMPTS
]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Mistral (window 24) with the default model's tokenizer, for text."""
    config_class, overrides = CASES["mistral-sliding-window"]
    path = save_tiny(
        tmp_path_factory.mktemp("mistral"), config_class, overrides | {"vocab_size": 49152}
    )
    for name in smollm2_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, path / name.name)
    return path


@pytest.fixture(scope="module")
def reference(mistral_dir: Path) -> list[str]:
    llm = OfflineLLM(ExecutorConfig(model=str(mistral_dir), block_size=8, swap_space=0.01))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [Request(str(i), prompt=p, params=params) for i, p in enumerate(LONG_PROMPTS)]
    return [r.outputs[0].text for r in llm.generate(requests, progress=False)]


@pytest.mark.parametrize("where", ["after_persist", "after_execute"])
def test_kill_9_after_blocks_left_the_window_loses_nothing(
    redis_url, mistral_dir, reference, where
):
    port = free_port()
    args = ["executor", "--port", str(port), "--model", str(mistral_dir), "--block-size", "8"]
    executor = start(
        [*args, "--num-gpu-blocks", "64", "--swap-space", "0.05"], f"executor-{port}.log"
    )
    namespace = f"test-crash-sliding-{uuid.uuid4().hex}"
    request = {"max_tokens": MAX_TOKENS}
    ids = [f"req-{where}-{i}" for i in range(len(LONG_PROMPTS))]
    proc = None
    try:
        proc, url = scheduler(redis_url, f"127.0.0.1:{port}", namespace, f"{where}:4")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

        def first_try(i: int) -> None:  # cut off by the crash
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    f"{url}/v1/completions",
                    json=body(model, LONG_PROMPTS[i]) | request,
                    headers={"X-Request-Id": ids[i]},
                    timeout=60,
                )

        threads = [threading.Thread(target=first_try, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        assert proc.wait(timeout=60) == -9, "the scheduler should have died at the crash point"
        stop(proc)
        for t in threads:
            t.join(timeout=60)
        proc, url = scheduler(redis_url, f"127.0.0.1:{port}", namespace)
        for i, request_id in enumerate(ids):  # the clients retry with their request ids
            r = httpx.post(
                f"{url}/v1/completions",
                json=body(model, LONG_PROMPTS[i]) | request,
                headers={"X-Request-Id": request_id},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference[i]
        assert _metric(url, "pagedserve_kv_blocks_freed_outside_window_total") > 0
        assert used_blocks(url) == 0
    finally:
        if proc is not None:
            stop(proc)
        stop(executor)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])
