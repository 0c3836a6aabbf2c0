"""Checks both front doors (HTTP and gRPC) run before a request reaches the engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pagedserve.model_files import load_generation_defaults
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ApiConfig
from scheduler_svc.api.errors import APIError
from scheduler_svc.api.protocol import ParsedRequest, Prompt, parse_completion
from scheduler_svc.core.scheduler import RequestRejectedError
from scheduler_svc.engine.async_engine import AsyncEngine

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ModelCard:
    """The model served, as the front doors describe it."""

    name: str
    vocab_size: int
    max_model_len: int
    # Request fields' defaults where the checkpoint sets its own (generation_config.json).
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)


def sampling_defaults(choice: str, model_files: Path) -> dict[str, float | int]:
    """The request defaults ``--generation-config`` names (see SchedulerOptions), checked
    now: a default no request could carry would otherwise make every request a 400."""
    if choice == "vllm":
        return {}
    source = model_files if choice == "auto" else Path(choice)
    if choice != "auto" and not (source / "generation_config.json").is_file():
        raise ValueError(f"--generation-config {choice}: no generation_config.json there")
    defaults = load_generation_defaults(source)
    try:
        parse_completion({"model": "", "prompt": [0]}, ApiConfig(), False, defaults=defaults)
    except APIError as e:
        raise ValueError(f"{source / 'generation_config.json'}: {e.message}") from None
    if defaults:
        log.info("sampling defaults from generation_config.json", **defaults)
    return defaults


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


def tokenize_prompts(tokenizer: Any, vocab_size: int, parsed: ParsedRequest) -> list[list[int]]:
    """Token ids of each prompt: chat messages through the chat template, text, or ids
    checked against the vocabulary. A batch's errors name the prompt (``prompt[i]``)."""
    if parsed.messages is not None:
        messages, extra = parsed.messages, {}
        if parsed.tools is not None:  # described in the template's tool section, or a message
            messages, extra = parsed.tools.prompt(tokenizer, messages)
        return [_nonempty(chat_prompt_ids(tokenizer, messages, **extra))]
    assert parsed.prompts is not None
    many = len(parsed.prompts) > 1
    return [
        _prompt_ids(tokenizer, vocab_size, p, f"prompt[{i}]" if many else "prompt")
        for i, p in enumerate(parsed.prompts)
    ]


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    **template_args: Any,
) -> list[int]:
    """A chat's prompt: the messages through the model's chat template (given
    ``template_args``, e.g. its tools), then encoded (the template writes its own special
    tokens, so none are added by default)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "this model has no chat template: use /v1/completions, or start the server with "
            "--chat-template FILE",
            param="messages",
        )
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_args
    )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_model(served: str, model: str | None) -> None:
    """404 for a model this server does not serve; None (not named) is this one."""
    if model is not None and model != served:
        raise APIError(
            404,
            f"model '{model}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


def _prompt_ids(tokenizer: Any, vocab_size: int, prompt: Prompt, param: str) -> list[int]:
    if isinstance(prompt, str):
        return _nonempty(tokenizer.encode(prompt), param)
    return check_vocabulary(prompt, vocab_size, param)


def check_vocabulary(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """``ids``, each checked to be in the vocabulary; APIError(400) naming ``param``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param=param
        )
    return list(ids)


def _nonempty(ids: list[int], param: str = "prompt") -> list[int]:
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param=param)
    return ids


def check_fits(engine: AsyncEngine, prompt_len: int, params: SamplingParams) -> None:
    """400 for a request the engine could never run (context or pool too small)."""
    try:
        engine.check(prompt_len, params)
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="max_tokens") from None
