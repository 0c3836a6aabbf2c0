"""Checks both front doors (HTTP and gRPC) run before a request reaches the engine."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ApiConfig
from scheduler_svc.api.errors import APIError
from scheduler_svc.api.protocol import ParsedRequest
from scheduler_svc.core.scheduler import RequestRejectedError
from scheduler_svc.engine.async_engine import AsyncEngine


def authorized(sent: bytes, key: str) -> bool:
    """Whether an Authorization value carries ``key``; constant time, so the time taken
    tells nothing of how much of a guess was right."""
    return hmac.compare_digest(sent, f"Bearer {key}".encode())


def owner_of(key: str | None) -> str:
    """Who a request recorded with this API key belongs to: a short hash of the key ("" on
    a server without one). With one shared key every holder of it is the same owner and
    may see (and abort) every request; separate owners come with one key per client."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def check_executor(engine: AsyncEngine, config: ApiConfig) -> None:
    """503 for new requests once the executor has been away longer than the budget."""
    away = engine.executor_unavailable_for()
    if away > config.executor_budget_s:
        raise APIError(
            503,
            f"the executor has been unreachable for {away:.0f} s; retry later",
            code="executor_unavailable",
            type="server_error",
        )


def tokenize_prompt(tokenizer: Any, vocab_size: int, parsed: ParsedRequest) -> list[int]:
    """Prompt token ids: chat messages through the chat template, text, or ids checked
    against the vocabulary."""
    if parsed.messages is not None:
        messages, extra = parsed.messages, {}
        if parsed.tools is not None:
            messages, extra = parsed.tools.prompt(tokenizer, messages)
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    elif isinstance(parsed.prompt, str):
        ids = tokenizer.encode(parsed.prompt)
    else:
        ids = list(parsed.prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


def check_fits(engine: AsyncEngine, prompt_len: int, params: SamplingParams) -> None:
    """400 for a request the engine could never run (context or pool too small)."""
    try:
        engine.check(prompt_len, params)
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="max_tokens") from None
