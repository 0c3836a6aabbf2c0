#!/usr/bin/env python3
"""What the HTTP front door spends checking one request body: the checks it runs (the whole
body walked by wire.decode_body, then protocol.parse_completion), against pydantic
validating the typed model of the same body (api/schema.py), which it does not run.

    python bench/request_checks.py
"""

from __future__ import annotations

import json
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from pydantic import BaseModel

from pagedserve.settings import ApiConfig
from scheduler_svc.api.protocol import parse_completion
from scheduler_svc.api.schema import ChatCompletionRequest, CompletionRequest
from scheduler_svc.api.wire import decode_body

CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about the sea. " * 20},
    ],
    "max_tokens": 128,
    "temperature": 0.7,
    "top_p": 0.9,
    "stream": True,
    "stream_options": {"include_usage": True},
}
IDS = {"model": "m", "prompt": list(range(256)), "max_tokens": 128, "stream": True}
CASES = [
    ("chat", CHAT, ChatCompletionRequest),
    ("completion, 256 token ids", IDS, CompletionRequest),
]


def best_us(fn: Callable[[], object], number: int = 2000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def measure(body: dict, model: type[BaseModel], config: ApiConfig) -> tuple[float, float]:
    """Microseconds per request: our checks, then pydantic's."""
    raw, chat = json.dumps(body).encode(), model is ChatCompletionRequest
    ours = best_us(lambda: parse_completion(decode_body(raw), config, chat))
    return ours, best_us(lambda: model.model_validate_json(raw))


def main() -> None:
    for name, body, model in CASES:
        ours, typed = measure(body, model, ApiConfig())
        print(f"{name}: our checks {ours:.1f} us, pydantic {typed:.1f} us per request")


if __name__ == "__main__":
    main()
