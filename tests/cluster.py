"""Registered executors and scheduler replicas on one Redis, for the scale-out tests."""

from __future__ import annotations

import functools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ExecutorConfig
from scheduler_svc.engine.executor_client import ExecutorClient
from tests.services import free_port, start, wait_healthy

MAX_TOKENS = 48


def start_executor(
    model_dir: Path,
    namespace: str,
    redis: str,
    drain_s: float = 3.0,
    port: int | None = None,
    num_gpu_blocks: int = 96,
):
    """A registered executor; ``port`` restarts one at the address it had."""
    port = port or free_port()
    args = ["executor", "--port", str(port), "--model", str(model_dir)]
    args += ["--num-gpu-blocks", str(num_gpu_blocks), "--swap-space", "0.05"]
    args += ["--state-store", redis, "--namespace", namespace, "--drain-timeout", str(drain_s)]
    proc = start(args, f"executor-{port}-{time.monotonic_ns()}.log")
    return proc, f"127.0.0.1:{port}"


def start_scheduler(namespace: str, *flags: str, redis: str):
    port = free_port()
    args = ["scheduler", "--port", str(port), "--state-store", redis, "--namespace", namespace]
    proc = start([*args, *flags], f"scheduler-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def wait_executors(url: str, count: int, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        executors = httpx.get(f"{url}/health", timeout=5).json().get("executors", [])
        if len(executors) == count:
            return executors
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not reach {count} executors: {executors}")


def num_steps(address: str) -> int:
    with ExecutorClient(address) as client:
        return client.get_stats().num_steps


@functools.cache
def model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]


def body(url: str, prompt: str, stream: bool = False, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": model_of(url),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def complete(url: str, prompt: str, request_id: str | None = None) -> str:
    headers = {"X-Request-Id": request_id} if request_id else {}
    response = httpx.post(
        f"{url}/v1/completions", json=body(url, prompt), headers=headers, timeout=300
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def stream_text(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """A streaming completion's text, concatenated from its SSE chunks."""
    text = ""
    request = body(url, prompt, stream=True, max_tokens=max_tokens)
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk["error"]
                text += chunk["choices"][0]["text"]
    return text


def reference_texts(
    model_dir: Path, prompts: list[str], max_tokens: int = MAX_TOKENS
) -> dict[str, str]:
    """Greedy texts of an uninterrupted in-process run."""
    llm = OfflineLLM(ExecutorConfig(model=str(model_dir), num_gpu_blocks=256, swap_space=0.01))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = llm.generate(
        [Request(str(i), prompt=p, params=params) for i, p in enumerate(prompts)], progress=False
    )
    return {p: r.outputs[0].text for p, r in zip(prompts, results, strict=True)}


def complete_all(url: str, prompts: list[str]) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p), prompts))


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples in /metrics (``name`` without ``pagedserve_``)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    samples = re.findall(rf"^pagedserve_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in samples)


def used_blocks(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(re.search(r'^pagedserve_kv_blocks_used\{device="gpu"\} (\S+)$', text, re.M)[1])


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took."""
    start_time = time.monotonic()
    while not predicate():
        if time.monotonic() - start_time > timeout:
            raise TimeoutError(f"not within {timeout} s: {what}")
        time.sleep(0.1)
    return time.monotonic() - start_time
