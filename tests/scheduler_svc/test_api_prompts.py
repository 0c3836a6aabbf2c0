"""Prompt lists on /v1/completions, on the shared guarded server: strings, one list of
token ids, or a list of token-id lists; each prompt answered with n choices, choice
i * n + j being sample j of prompt i as OpenAI numbers them, whole and streamed, usage
summed; a bad prompt in a list named by its index, and a batch whose client leaves
aborted whole."""

from __future__ import annotations

import contextlib
import json
import re
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.openai_spec import assert_conforms
from tests.services import GUARD_KEY, executor_pid, held_still

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}
PROMPTS = ["The harbour at dawn", "A letter from the coast"]


def complete(server: SimpleNamespace, body: dict) -> dict:
    r = server.client.post("/v1/completions", json={"model": server.model} | body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert_conforms("CreateCompletionResponse", r.json())
    return r.json()


def streamed(server: SimpleNamespace, body: dict) -> tuple[dict[int, str], dict]:
    """Each choice's text joined from a stream's chunks, and the stream's usage."""
    body = {"model": server.model, "stream": True} | body
    body |= {"stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    with server.client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    for chunk in chunks:
        assert_conforms("CompletionStreamChunk", chunk)
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, chunks[-1]["usage"]


def test_a_prompt_list_answers_each_prompt_n_times_in_openai_order(guarded_server):
    server = guarded_server
    sampled = {"max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    alone = [complete(server, sampled | {"prompt": p}) for p in PROMPTS]
    batch = complete(server, sampled | {"prompt": PROMPTS})
    expected = [c["text"] for one in alone for c in one["choices"]]  # prompt i, sample j
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == expected
    assert len(set(expected)) > 2, expected  # the samples differ, so the order is tested
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(one["usage"][field] for one in alone)
    texts, usage = streamed(server, sampled | {"prompt": PROMPTS})
    assert [texts[i] for i in range(4)] == expected and usage == batch["usage"]


def test_a_prompt_list_retried_under_its_id_gets_the_stored_answer(guarded_server):
    server = guarded_server
    body = {"model": server.model, "prompt": PROMPTS, "max_tokens": 6, "n": 2, "temperature": 1}
    headers = AUTH | {"X-Request-Id": f"batch-{time.time_ns()}"}
    first = server.client.post("/v1/completions", json=body, headers=headers)
    generated = gauge(server, "generation_tokens_total")
    again = server.client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200, again.text
    assert first.headers["x-request-id"] == headers["X-Request-Id"] == first.json()["id"]
    assert gauge(server, "generation_tokens_total") == generated  # nothing ran again
    assert again.json()["choices"] == first.json()["choices"]
    other = server.client.post("/v1/completions", json=body | {"n": 1}, headers=headers)
    assert other.status_code == 409, other.text


def test_token_id_prompts_in_every_form(guarded_server):
    server = guarded_server
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    by_text = complete(server, greedy | {"prompt": PROMPTS})
    singles = [complete(server, greedy | {"prompt": p}) for p in PROMPTS]
    token_lists = [
        server.client.post(
            "/tokenize", json={"model": server.model, "prompt": p}, headers=AUTH
        ).json()["tokens"]
        for p in PROMPTS
    ]
    by_ids = complete(server, greedy | {"prompt": token_lists})
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    one = complete(server, greedy | {"prompt": token_lists[1]})
    assert one["choices"][0]["text"] == singles[1]["choices"][0]["text"]
    assert one["usage"]["prompt_tokens"] == len(token_lists[1])


BAD_LISTS = [
    (["x", ""], "prompt[1]"),
    ([[1, 2], []], "prompt[1]"),
    ([[1, 2], [99999999]], "prompt[1]"),
    (["x", 5], "prompt"),
    (["x", [1, 2]], "prompt"),
    ([[1, 2], [True]], "prompt"),
    ([], "prompt"),
    (["x"] * 65, "prompt"),
]


@pytest.mark.parametrize(("prompt", "param"), BAD_LISTS)
def test_a_bad_prompt_list_is_a_400_naming_it(guarded_server, prompt, param):
    body = {"model": guarded_server.model, "prompt": prompt, "max_tokens": 1}
    r = guarded_server.client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_prompt_list_cannot_be_resumed(guarded_server):
    body = {"model": guarded_server.model, "prompt": PROMPTS, "max_tokens": 2, "stream": True}
    headers = AUTH | {"X-Resumable-Stream": "true"}
    r = guarded_server.client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def gauge(server: SimpleNamespace, name: str) -> float:
    text = server.client.get("/metrics", headers=AUTH).text
    return float(re.search(rf"^pagedserve_{re.escape(name)} (\S+)$", text, re.M)[1])


def test_a_batch_whose_client_leaves_is_aborted_whole(guarded_server):
    server = guarded_server
    body = {"model": server.model, "prompt": PROMPTS * 2, "max_tokens": 1000, "stream": True}
    body |= {"ignore_eos": True}
    aborted = 'requests_total{finish_reason="abort"}'
    before = {name: gauge(server, name) for name in (aborted, "generation_tokens_total")}
    url = f"{server.url}/v1/completions"
    # Left last to first: the client leaves, then the executor held still since the first
    # event goes on, so the client surely left while the four still ran.
    with contextlib.ExitStack() as hold, httpx.stream("POST", url, json=body, headers=AUTH) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
        hold.enter_context(held_still(executor_pid(server.proc)))
    deadline = time.monotonic() + 10
    while gauge(server, aborted) < before[aborted] + 4:
        assert time.monotonic() < deadline, "a request of the batch still runs"
        time.sleep(0.1)
    assert gauge(server, aborted) == before[aborted] + 4
    generated = gauge(server, "generation_tokens_total") - before["generation_tokens_total"]
    assert generated < 1000  # none of the four ran to its end
    assert gauge(server, 'kv_blocks_used{device="gpu"}') == 0
