"""kill -9 of the scheduler at each step boundary, then a restart on the same Redis:
every accepted request completes, greedy text is byte-identical to an uninterrupted run,
and no KV block leaks. Real processes: executor, scheduler, redis-server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import uuid
from pathlib import Path

import httpx
import jsonschema
import pytest

from pagedserve.grammar import Grammar
from pagedserve.offline import OfflineLLM, Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ExecutorConfig
from tests.cluster import metric, wait_until
from tests.services import free_port, start, stop, wait_healthy

pytestmark = pytest.mark.redis
PROMPTS = ["The harbour committee met", "A fisherman asked who would pay", "By noon the mayor"]
MAX_TOKENS = 24
HOUSE = {  # a constrained generation the tiny random model can only finish by its grammar
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rooms": {"type": "array", "items": {"enum": ["hall", "kitchen"]}, "maxItems": 3},
        "floors": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rooms", "floors"],
}


def executor_args(model_dir: Path, port: int) -> list[str]:
    return [
        "executor",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--num-gpu-blocks",
        "128",
        "--swap-space",
        "0.05",
    ]


@pytest.fixture(scope="module")
def executor(tiny_chat_model_dir: Path):
    port = free_port()
    proc = start(executor_args(tiny_chat_model_dir, port), f"executor-{port}.log")
    yield f"127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def namespace() -> str:
    """One deployment for the module: its fencing epochs only grow, as the executor expects."""
    return f"test-crash-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir: Path) -> list[str]:
    llm = OfflineLLM(
        ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(
        [Request(str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)], progress=False
    )
    return [r.outputs[0].text for r in results]


@pytest.fixture(scope="module")
def constrained_reference(tiny_chat_model_dir: Path) -> str:
    llm = OfflineLLM(
        ExecutorConfig(model=str(tiny_chat_model_dir), num_gpu_blocks=64, swap_space=0.01)
    )
    grammar = Grammar("json_schema", json.dumps(HOUSE))
    params = SamplingParams(temperature=0, max_tokens=4 * MAX_TOKENS, grammar=grammar)
    [result] = llm.generate([Request("0", prompt=PROMPTS[0], params=params)], progress=False)
    return result.outputs[0].text


def scheduler(
    redis_url: str,
    executor: str,
    namespace: str,
    crash_at: str | None = None,
    flags: tuple[str, ...] = (),
):
    port = free_port()
    env = {"PAGEDSERVE_CRASH_AT": crash_at} if crash_at else {}
    proc = start(
        [
            "scheduler",
            "--executor",
            executor,
            "--port",
            str(port),
            "--state-store",
            redis_url,
            "--namespace",
            namespace,
            *flags,
        ],
        f"scheduler-{port}.log",
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def body(model: str, prompt: str, stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def used_blocks(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r'^pagedserve_kv_blocks_used\{device="gpu"\} (\S+)$', text, re.M)[1])


@pytest.mark.parametrize(
    ("where", "budget"),
    [
        ("before_persist", None),
        # Applied by the executor, not journaled: the restart recomputes every group.
        ("after_send", None),
        ("after_persist", None),
        ("after_execute", None),
        # Three tokens a step: the crash falls while the prompts go in chunks.
        ("after_send", 3),
        ("after_persist", 3),
        ("after_execute", 3),
    ],
)
def test_kill_9_at_a_step_boundary_loses_nothing(
    redis_url, executor, namespace, reference, where, budget
):
    flags = ("--max-num-batched-tokens", str(budget)) if budget else ()
    step = 2 if budget else 4
    proc, url = scheduler(redis_url, executor, namespace, f"{where}:{step}", flags)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    ids = [f"req-{where}-{budget}-{i}" for i in range(len(PROMPTS))]

    def first_try(i: int) -> None:  # cut off by the crash
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{url}/v1/completions",
                json=body(model, PROMPTS[i]),
                headers={"X-Request-Id": ids[i]},
                timeout=60,
            )

    threads = [threading.Thread(target=first_try, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    try:
        assert proc.wait(timeout=60) == -9, "the scheduler should have died at the crash point"
    finally:
        stop(proc)
    for t in threads:
        t.join(timeout=60)
    proc, url = scheduler(redis_url, executor, namespace, flags=flags)
    try:
        for i, request_id in enumerate(ids):  # the clients retry with their request ids
            r = httpx.post(
                f"{url}/v1/completions",
                json=body(model, PROMPTS[i]),
                headers={"X-Request-Id": request_id},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == reference[i] and choice["finish_reason"] == "length"
        assert used_blocks(url) == 0
    finally:
        stop(proc)


def test_a_request_finished_by_the_replayed_step_is_counted_once(
    redis_url, executor, namespace, reference
):
    """Killed after the executor ran the step that finishes a request, before that step's
    results were committed: the next scheduler sends the step again, which finishes the
    request there, and counts it (once: the client's retry reads the stored answer)."""
    flags = ("--no-async-scheduling", "--num-decode-steps=1")
    proc, url = scheduler(redis_url, executor, namespace, f"after_execute:{MAX_TOKENS}", flags)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    request_id = f"req-replayed-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": request_id}
    with contextlib.suppress(httpx.HTTPError):  # cut off by the crash
        httpx.post(f"{url}/v1/completions", json=body(model, PROMPTS[0]), headers=headers)
    try:
        assert proc.wait(timeout=60) == -9, "the scheduler should have died at the crash point"
    finally:
        stop(proc)
    proc, url = scheduler(redis_url, executor, namespace, flags=flags)
    try:
        wait_until(lambda: metric(url, "requests_total") >= 1, 30, "the replayed request counted")
        r = httpx.post(
            f"{url}/v1/completions", json=body(model, PROMPTS[0]), headers=headers, timeout=60
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[0]
        assert metric(url, "requests_total") == 1
        assert used_blocks(url) == 0
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("crash_at", "flags"),
    [
        # Half-way through the stream: the first event goes out once its commit lands, while
        # the steps go on, so a crash a few steps in could beat it to the client.
        (f"after_execute:{MAX_TOKENS // 2}", ()),
        # One call at a time, four decode steps a call: the scheduler dies once the executor
        # has run its fifth call, whose commit it never made, so the new leader recomputes
        # the fourth and fifth: the client must not have had the fourth's event (four tokens;
        # the recomputation makes it one), nor any event the store lacks.
        (
            "after_send:5",
            (
                "--no-async-scheduling",
                "--num-decode-steps=4",
                "--decode-steps-quiet=0",
                "--decode-steps-span=0",
            ),
        ),
    ],
    ids=["async", "one-at-a-time-in-a-row"],
)
def test_a_stream_resumes_after_the_last_event_it_got(
    redis_url, executor, namespace, reference, crash_at, flags
):
    proc, url = scheduler(redis_url, executor, namespace, crash_at=crash_at, flags=flags)
    request_id = f"streamed-{uuid.uuid4().hex}"
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    got, last_id, seen = "", None, []
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body(model, PROMPTS[0], True),
            headers={"X-Request-Id": request_id, "X-Resumable-Stream": "true"},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("id: "):
                    last_id = line[4:]
                elif line.startswith("data: {"):
                    got += json.loads(line[6:])["choices"][0]["text"]
                    seen.append((last_id, got))
    except httpx.HTTPError:
        pass  # the scheduler died mid-stream
    try:
        assert proc.wait(timeout=60) == -9
    finally:
        stop(proc)
    # On a loaded machine the crash may beat every event to the client (it did once in CI):
    # the client then asks for the stream from its start.
    resume = {} if last_id is None else {"Last-Event-ID": last_id}
    proc, url = scheduler(redis_url, executor, namespace)
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body(model, PROMPTS[0], True),
            headers={"X-Request-Id": request_id} | resume,
            timeout=60,
        ) as r:
            event_id = None
            for line in r.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: {"):
                    got += json.loads(line[6:])["choices"][0]["text"]
                    seen.append((event_id, got))
        assert got == reference[0], f"events (id, text so far): {seen}"
    finally:
        stop(proc)


def test_executor_kill_9_is_a_delay_not_an_error(
    redis_url, tiny_chat_model_dir, namespace, reference
):
    port = free_port()
    args = executor_args(tiny_chat_model_dir, port)
    executor = start(args, f"executor-{port}.log")
    results: dict[int, httpx.Response] = {}

    def client(i: int) -> None:
        results[i] = httpx.post(f"{url}/v1/completions", json=body(model, PROMPTS[i]), timeout=120)

    proc = None
    try:  # the executor is stopped also when the scheduler does not start
        proc, url = scheduler(redis_url, f"127.0.0.1:{port}", f"{namespace}-executor")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body(model, PROMPTS[0], True), timeout=120
        ) as first:
            lines = first.iter_lines()
            line = next(lines)
            while not line.startswith("data: {"):  # wait until generation is under way
                line = next(lines)
            text = json.loads(line[6:])["choices"][0]["text"]
            threads = [threading.Thread(target=client, args=(i,)) for i in (1, 2)]
            for t in threads:
                t.start()
            os.killpg(executor.pid, signal.SIGKILL)
            executor.wait()
            executor = start(args, f"executor-{port}-again.log")  # same address, empty pools
            for line in lines:
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        for t in threads:
            t.join(timeout=120)
        assert all(results[i].status_code == 200 for i in (1, 2))
        assert [results[i].json()["choices"][0]["text"] for i in (1, 2)] == reference[1:]
        assert text == reference[0] and used_blocks(url) == 0
    finally:
        if proc is not None:
            stop(proc)
        stop(executor)


def test_a_constrained_generation_is_the_same_after_a_kill_9(
    redis_url, executor, namespace, constrained_reference
):
    """The executor's grammar state outlives the scheduler: the pending step's replay
    answers its stored tokens, and every later step brings the matcher along by its output."""
    proc, url = scheduler(redis_url, executor, namespace, crash_at="after_execute:4")
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    request = body(model, PROMPTS[0]) | {
        "max_tokens": 4 * MAX_TOKENS,
        "ignore_eos": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": HOUSE}},
    }
    headers = {"X-Request-Id": "constrained"}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/completions", json=request, headers=headers, timeout=60)
    try:
        assert proc.wait(timeout=60) == -9, "the scheduler should have died at the crash point"
    finally:
        stop(proc)
    proc, url = scheduler(redis_url, executor, namespace)
    try:
        r = httpx.post(f"{url}/v1/completions", json=request, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == constrained_reference and choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), HOUSE)
        assert used_blocks(url) == 0
    finally:
        stop(proc)
