"""Steady load for the fault suite: streaming and non-streaming completions, greedy and
seeded, sent by clients that retry as the API asks (same request id, ``Last-Event-ID`` on a
resumable stream, ``Retry-After`` on a 503), each request judged against a reference text."""

from __future__ import annotations

import enum
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

RETRYABLE = {409, 429, 503}  # a 5xx without JSON is retried too, as unclear
RETRYABLE_CODES = {"conflict", "queue_full", "engine_unavailable", "store_unavailable"}


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the load; equal specs must give byte-identical text."""

    prompt: str
    stream: bool
    seed: int | None  # None: greedy
    max_tokens: int = 32

    @property
    def kind(self) -> str:
        """E.g. "stream, seed 7" or "whole, greedy"."""
        sampling = "greedy" if self.seed is None else f"seed {self.seed}"
        return f"{'stream' if self.stream else 'whole'}, {sampling}"

    def body(self, model: str) -> dict:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens}
        body |= {"ignore_eos": True, "stream": self.stream}
        if self.seed is None:
            return body | {"temperature": 0}
        return body | {"temperature": 0.8, "seed": self.seed}


def specs(num: int, max_tokens: int) -> list[Spec]:
    """``num`` distinct requests cycling through stream x sampling."""
    kinds = itertools.cycle([(False, None), (True, None), (False, 7), (True, 11)])
    prompt = "Note {}: at dawn the harbour master counted the boats and"
    return [Spec(prompt.format(i), *next(kinds), max_tokens) for i in range(num)]


class Outcome(enum.StrEnum):
    CORRECT = "correct"
    WRONG = "wrong"  # finished, text differs from the reference
    FAILED = "failed"  # gave up after an error the client can act on
    LOST = "lost"  # no answer, a hang or only unclear errors by the deadline


@dataclass(slots=True)
class Record:
    """What one request went through."""

    spec: Spec
    started: float
    ended: float = 0.0
    outcome: Outcome = Outcome.LOST
    text: str = ""
    retries: int = 0
    clear_errors: int = 0
    dropped: int = 0  # connections cut under the client (a killed replica cannot answer)
    unclear_errors: int = 0  # answers not OpenAI-style
    errors: list[str] = field(default_factory=list)  # every failed try, by kind


class Attempt(Exception):
    """One try that did not finish; ``clear`` when the server said why, OpenAI-style,
    ``dropped`` when the connection broke before it could, ``final`` when a retry cannot
    help (a 4xx other than 409 and 429)."""

    def __init__(
        self,
        what: str,
        clear: bool,
        wait_s: float = 0.5,
        dropped: bool = False,
        final: bool = False,
    ) -> None:
        super().__init__(what)
        self.clear, self.wait_s, self.dropped, self.final = clear, wait_s, dropped, final


def judge_error(response: httpx.Response) -> Attempt:
    """An error answer: clear when it is OpenAI-style JSON and a 503 says when to retry."""
    try:
        error = json.loads(response.read())["error"]
        clear, code = "message" in error, error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        clear, code = False, None
    retry_after = response.headers.get("retry-after")
    if response.status_code in (429, 503) and retry_after is None:
        clear = False
    wait = min(float(retry_after), 5.0) if retry_after and retry_after.isdigit() else 0.5
    status = response.status_code
    final = clear and 400 <= status < 500 and status not in RETRYABLE
    return Attempt(f"HTTP {status} {code}", clear, wait, final=final)


class Client:
    """Sends specs to whichever replicas are up, retrying until each finishes or its
    deadline passes (with ``retry`` False: one try each)."""

    def __init__(
        self, urls: Callable[[], list[str]], model: str, deadline_s: float, retry: bool = True
    ) -> None:
        self.urls, self.model, self.deadline_s, self.retry = urls, model, deadline_s, retry
        self._turn = itertools.count()

    def run(self, spec: Spec) -> Record:
        record = Record(spec, time.monotonic())
        headers = {"X-Request-Id": f"faults-{uuid.uuid4().hex}"}
        if spec.stream:
            headers["X-Resumable-Stream"] = "true"
        state = {"text": "", "last_id": None}
        while time.monotonic() - record.started < self.deadline_s:
            try:
                record.text = self._attempt(spec, headers, state)
                record.outcome = Outcome.CORRECT  # judged against the reference later
                break
            except Attempt as attempt:
                record.retries += 1
                record.outcome = Outcome.FAILED if attempt.clear else Outcome.LOST
                record.errors.append(str(attempt))
                if attempt.clear:
                    record.clear_errors += 1
                elif attempt.dropped:
                    record.dropped += 1
                else:
                    record.unclear_errors += 1
                if attempt.final or not self.retry:
                    break
                time.sleep(attempt.wait_s)
        record.ended = time.monotonic()
        return record

    def _url(self) -> str:
        urls = self.urls()
        if not urls:
            raise Attempt("no scheduler running", clear=False, dropped=True)
        return urls[next(self._turn) % len(urls)]

    def _attempt(self, spec: Spec, headers: dict, state: dict) -> str:
        timeout = httpx.Timeout(self.deadline_s, connect=5)
        url = f"{self._url()}/v1/completions"
        if state["last_id"] is not None:
            headers = headers | {"Last-Event-ID": state["last_id"]}
        try:
            with httpx.stream(
                "POST", url, json=spec.body(self.model), headers=headers, timeout=timeout
            ) as r:
                if r.status_code != 200:
                    raise judge_error(r)
                if not spec.stream:
                    r.read()
                    return r.json()["choices"][0]["text"]
                return read_stream(r, state)
        except httpx.TransportError as error:
            raise Attempt(type(error).__name__, clear=False, dropped=True) from None


def read_stream(response: httpx.Response, state: dict) -> str:
    """The stream's text, kept in ``state`` with the last event id so that a broken stream
    resumes where it stopped."""
    if state["last_id"] is None:
        state["text"] = ""
    done = False
    for line in response.iter_lines():
        if line.startswith("id: "):
            state["last_id"] = line[4:]
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                code, clear = error.get("code"), "message" in error
                final = clear and code not in RETRYABLE_CODES
                raise Attempt(f"stream error {code}", clear, final=final)
            state["text"] += chunk["choices"][0]["text"]
    if not done:
        raise Attempt("stream ended without [DONE]", clear=False)
    return state["text"]


def run_load(client: Client, load: list[Spec], concurrency: int, duration_s: float) -> list[Record]:
    """``concurrency`` clients send ``load`` round and round for ``duration_s`` seconds;
    returns once every request sent has finished or passed its deadline."""
    end = time.monotonic() + duration_s
    queue = itertools.cycle(load)
    lock = threading.Lock()

    def worker() -> list[Record]:
        records = []
        while time.monotonic() < end:
            with lock:
                spec = next(queue)
            records.append(client.run(spec))
        return records

    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(worker) for _ in range(concurrency)]
        return [r for f in futures for r in f.result()]


def run_paced(
    client: Client, load: list[Spec], rate: float, duration_s: float, max_in_flight: int = 64
) -> list[Record]:
    """Open-loop load: one request every 1/``rate`` seconds for ``duration_s`` seconds,
    whatever the server's pace (up to ``max_in_flight`` at once); returns once every
    request has finished or timed out."""
    queue, futures = itertools.cycle(load), []
    start = time.monotonic()
    with ThreadPoolExecutor(max_in_flight) as pool:
        for i in itertools.count():
            due = start + i / rate
            if due > start + duration_s:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            futures.append(pool.submit(client.run, next(queue)))
        return [f.result() for f in futures]


def judge(records: list[Record], reference: dict[Spec, str]) -> None:
    """Mark finished requests whose text differs from the reference as WRONG."""
    for record in records:
        if record.outcome is Outcome.CORRECT and record.text != reference[record.spec]:
            record.outcome = Outcome.WRONG
