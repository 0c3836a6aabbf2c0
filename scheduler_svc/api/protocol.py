"""Parses and validates OpenAI-style request bodies before anything is allocated."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.grammar import Grammar
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.settings import ApiConfig
from scheduler_svc.api.errors import APIError
from scheduler_svc.api.errors import require as _check
from scheduler_svc.api.structured import check_compiles, parse_structured
from scheduler_svc.api.tools import ToolPlan, calls_as_text, parse_tools

MAX_TEMPERATURE = 2.0  # OpenAI's bound; the engine takes any finite temperature
# Request ids name Redis keys, log lines and the X-Request-Id response header: visible ASCII.
_REQUEST_ID = re.compile(r"[!-~]{1,256}")


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion or chat request, prompt not yet tokenized."""

    model: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    stream: bool
    logprobs: int | None  # alternatives per token to return; None = no logprobs
    request_id: str | None
    include_usage: bool
    tools: ToolPlan | None = None  # chat only; None also for tool_choice "none"


def _get(data: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = data.get(name, default)
    if value is None:
        return default
    # bool is an int to Python, but "n": true is a client bug, not 1.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(
            400, f"'{name}' must be of type {names}, got {type(value).__name__}", param=name
        )
    return value


def _number(data: dict, name: str, default: float) -> float:
    value = _get(data, name, (int, float), default)
    try:
        value = float(value)
    except OverflowError:  # an integer past any float
        value = math.inf
    if not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a finite number, got {value}", param=name)
    return value


def parse_completion(
    data: dict[str, Any], config: ApiConfig, chat: bool, timeout_header: str | None = None
) -> ParsedRequest:
    """Validate every field named by the OpenAI API that we honour; raise APIError(400),
    also for a field that would change the answer's meaning and is not supported."""
    _refuse_unsupported(data)
    model = _get(data, "model", (str,))
    _check(model is not None, "'model' is required", "model")
    prompt, messages, tools = None, None, None
    if chat:
        messages = _parse_messages(data)
        tools = parse_tools(data)
    else:
        prompt = _parse_prompt(data)
        _check(not data.get("tools"), "'tools' are for chat completions", "tools")
    n = _get(data, "n", (int,), 1)
    _check(1 <= n <= config.max_n, f"'n' must be in [1, {config.max_n}], got {n}", "n")
    best_of = _get(data, "best_of", (int,))
    if best_of is not None:
        _check(
            best_of <= config.max_n,
            f"'best_of' must be <= {config.max_n}, got {best_of}",
            "best_of",
        )
        _check(best_of >= n, f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    beam = _get(data, "use_beam_search", (bool,), False)
    max_tokens = _get(
        data,
        "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens",
        (int,),
        16,
    )
    name = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
    _check(max_tokens >= 1, f"'{name}' must be >= 1, got {max_tokens}", name)
    temperature = _number(data, "temperature", 0.0 if beam else 1.0)
    _check(
        0 <= temperature <= MAX_TEMPERATURE,
        f"'temperature' must be in [0, {MAX_TEMPERATURE}], got {temperature}",
        "temperature",
    )
    top_p = _number(data, "top_p", 1.0)
    _check(0 < top_p <= 1, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(data, "top_k", (int,), -1)
    _check(top_k >= -1 and top_k != 0, f"'top_k' must be -1 or >= 1, got {top_k}", "top_k")
    logprobs = _parse_logprobs(data, config, chat)
    stream = _get(data, "stream", (bool,), False)
    _check(
        not (stream and (beam or (best_of or n) > n)),
        "streaming is not available with beam search or best_of > n",
        "stream",
    )
    stop = _get(data, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    _check(
        all(isinstance(s, str) and s for s in stop) and len(stop) <= 16,
        "'stop' must be a non-empty string or a list of up to 16 of them",
        "stop",
    )
    stream_options = _get(data, "stream_options", (dict,), {})
    try:
        params = SamplingParams(
            n=n,
            best_of=best_of if best_of is not None else (n if beam else None),
            use_beam_search=beam,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=_number(data, "min_p", 0.0),
            repetition_penalty=_number(data, "repetition_penalty", 1.0),
            presence_penalty=_number(data, "presence_penalty", 0.0),
            frequency_penalty=_number(data, "frequency_penalty", 0.0),
            max_tokens=max_tokens,
            ignore_eos=_get(data, "ignore_eos", (bool,), False),
            stop_token_ids=tuple(_get(data, "stop_token_ids", (list,), [])),
            stop=tuple(stop),
            seed=_get(data, "seed", (int,)),
            logprobs=logprobs,
            length_penalty=_number(data, "length_penalty", 1.0),
            grammar=_grammar(data, tools),
            priority=_get(data, "priority", (int,), 0),
            timeout=_timeout(data, timeout_header),
        )
    except InvalidSamplingParam as e:
        raise APIError(400, str(e), param=e.param) from None
    request_id = check_request_id(_get(data, "request_id", (str,)), "request_id")
    return ParsedRequest(
        model,
        prompt,
        messages,
        params,
        stream,
        logprobs,
        request_id,
        bool(stream_options.get("include_usage", False)),
        tools,
    )


def _grammar(data: dict, tools: ToolPlan | None) -> Grammar | None:
    """The request's structured output, or the schema its forced tool call must match."""
    grammar = parse_structured(data)
    forced = tools.grammar() if tools is not None else None
    if forced is not None:
        check_compiles(forced, "tools")
    _check(
        grammar is None or forced is None,
        "a forced tool call cannot be combined with a structured output",
        "tool_choice",
    )
    return grammar or forced


def _timeout(data: dict, header: str | None) -> float | None:
    """Seconds the request may take: the body's ``timeout``, else ``X-Request-Timeout``."""
    if data.get("timeout") is not None:
        return _number(data, "timeout", 0.0)
    if header is None:
        return None
    try:
        return float(header)
    except ValueError:
        raise APIError(
            400,
            f"X-Request-Timeout must be seconds, got {header[:40]!r}",
            param="X-Request-Timeout",
        ) from None


def check_request_id(value: str | None, param: str) -> str | None:
    """``value`` when it is a usable request id (or None); APIError(400) otherwise."""
    if value is not None and not _REQUEST_ID.fullmatch(value):
        raise APIError(400, f"'{param}' must be 1 to 256 visible ASCII characters", param=param)
    return value


def _parse_prompt(data: dict) -> str | list[int]:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check(prompt != "", "'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        _check(len(prompt) > 0, "'prompt' must not be empty", "prompt")
        return prompt
    _check(prompt is not None, "'prompt' is required", "prompt")
    raise APIError(
        400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
    )


def _parse_messages(data: dict) -> list[dict[str, str]]:
    messages = data.get("messages")
    _check(
        isinstance(messages, list) and len(messages) > 0,
        "'messages' must be a non-empty list",
        "messages",
    )
    parsed = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls") is not None:
            text = calls_as_text(m["tool_calls"], f"messages[{i}].tool_calls")
            m = m | {"content": text}  # an assistant's calls, as it wrote them
        _check(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str | list),
            f"'messages[{i}]' must have a string 'role' and a string or list 'content'",
            f"messages[{i}]",
        )
        parsed.append({"role": m["role"], "content": _message_text(m["content"], i)})
    return parsed


def _message_text(content: str | list, index: int) -> str:
    """A message's text: a string, or its text parts joined by newlines (as vLLM joins
    them). A part of another kind (an image, audio, a file) is refused, by name."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        _check(isinstance(part, dict), f"'{param}' must be an object", param)
        kind = part.get("type")
        _check(
            kind == "text",
            f"'{param}' is a {kind!r} part; this server reads text parts only",
            param,
        )
        _check(isinstance(part.get("text"), str), f"'{param}.text' must be a string", param)
        texts.append(part["text"])
    return "\n".join(texts)


# Fields that would change what the answer means, refused by name until supported; a value
# that asks for nothing (the one given) is accepted.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


def _refuse_unsupported(data: dict) -> None:
    for name, harmless in _UNSUPPORTED.items():
        if name in data and data[name] not in harmless:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def _parse_logprobs(data: dict, config: ApiConfig, chat: bool) -> int | None:
    if chat:
        if not _get(data, "logprobs", (bool,), False):
            return None
        value, name = _get(data, "top_logprobs", (int,), 0), "top_logprobs"
    else:
        value, name = _get(data, "logprobs", (int,)), "logprobs"
        if value is None:
            return None
    _check(
        0 <= value <= config.max_logprobs,
        f"'{name}' must be in [0, {config.max_logprobs}], got {value}",
        name,
    )
    return value
