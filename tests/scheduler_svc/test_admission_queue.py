"""A bounded waiting queue: beyond --max-waiting-requests the leader answers 429 with
Retry-After, counts the refusal, and every request it admitted still gets its whole answer.
Real processes: `pagedserve serve` on the tiny chat model."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.services import serve

MAX_TOKENS = 200  # long enough that the burst lands while the first ones run
BURST = 12


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path):
    # One sequence runs at a time, so a burst waits; at most 3 may wait.
    flags = ["--num-gpu-blocks", "64", "--max-num-seqs", "1", "--max-waiting-requests", "3"]
    with serve(tiny_chat_model_dir, *flags, "--executor-metrics-port", "0") as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model


def refused(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(
        r'^pagedserve_requests_refused_total\{reason="queue_full"\} (\S+)$', text, re.M
    )
    assert match, "pagedserve_requests_refused_total missing from /metrics"
    return float(match[1])


def complete(url: str, model: str, i: int) -> httpx.Response:
    body = {"model": model, "prompt": f"Story {i}:", "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def test_a_burst_beyond_the_queue_gets_429_and_the_admitted_finish(server):
    url, model = server
    before = refused(url)
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda i: complete(url, model, i), range(BURST)))
    ok = [r for r in answers if r.status_code == 200]
    full = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(full) == BURST, [r.status_code for r in answers]
    assert ok and full
    for r in full:
        assert r.headers["retry-after"] == "2"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert refused(url) - before == len(full)
    assert complete(url, model, 99).status_code == 200  # room again once they finished


def test_the_openai_client_sees_a_rate_limit_error(server):
    url, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with ThreadPoolExecutor(BURST) as pool:
        results = list(
            pool.map(
                lambda i: _call(client, model, i),
                range(BURST),
            )
        )
    assert any(isinstance(r, openai.RateLimitError) for r in results)
    assert all(isinstance(r, openai.RateLimitError | str) for r in results), results


def _call(client: openai.OpenAI, model: str, i: int) -> str | Exception:
    try:
        return (
            client.completions.create(
                model=model, prompt=f"Tale {i}:", max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
        )
    except openai.APIError as e:
        return e
