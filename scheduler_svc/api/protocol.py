"""Parses and validates OpenAI-style request bodies before anything is allocated."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pagedserve.grammar import Grammar
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.settings import ApiConfig
from scheduler_svc.api.errors import APIError
from scheduler_svc.api.errors import require as _check
from scheduler_svc.api.structured import check_compiles, parse_structured
from scheduler_svc.api.tools import ToolPlan, calls_as_text, parse_tools

Prompt = str | list[int]  # text, or token ids
MAX_TEMPERATURE = 2.0  # OpenAI's bound; the engine takes any finite temperature
# What a request leaves out gets, unless the checkpoint's generation_config.json says otherwise.
BUILTIN_DEFAULTS = MappingProxyType(
    {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 16,
    }
)
# Request ids name Redis keys, log lines and the X-Request-Id response header: visible ASCII.
_REQUEST_ID = re.compile(r"[!-~]{1,256}")


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion or chat request, prompts not yet tokenized."""

    model: str
    prompts: list[Prompt] | None  # a completion's prompts, each answered with n choices
    messages: list[dict[str, str]] | None
    params: SamplingParams
    stream: bool
    logprobs: int | None  # alternatives per token to return; None = no logprobs
    request_id: str | None
    include_usage: bool
    echo: bool = False  # completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None  # vLLM's field: alternatives per prompt token
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
    data: dict[str, Any],
    config: ApiConfig,
    chat: bool,
    timeout_header: str | None = None,
    defaults: Mapping[str, float | int] = MappingProxyType({}),
) -> ParsedRequest:
    """Validate every field named by the OpenAI API that we honour; raise APIError(400),
    also for a field that would change the answer's meaning and is not supported.

    Args:
        defaults: values, by field name, for the sampling fields a request leaves out
            (the checkpoint's generation_config.json); not applied to beam search's.
    """
    _refuse_unsupported(data)
    model = _get(data, "model", (str,))
    _check(model is not None, "'model' is required", "model")
    prompts, messages, tools = None, None, None
    if chat:
        messages = _parse_messages(data, config.max_messages)
        tools = parse_tools(data)
    else:
        prompts = _parse_prompts(data, config.max_prompts)
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
    default = _request_defaults(defaults, beam)
    max_tokens, name = _max_tokens(data, default["max_tokens"])
    echo = _get(data, "echo", (bool,), False)
    _check(not (chat and echo), "'echo' is available for completions, not chat", "echo")
    prompt_logprobs = _logprobs_count(data, "prompt_logprobs", config)
    _check(
        max_tokens >= 1 or (max_tokens == 0 and (echo or prompt_logprobs is not None)),
        f"'{name}' must be >= 1 (0 only with echo or prompt_logprobs), got {max_tokens}",
        name,
    )
    for scored, field in ((echo, "echo"), (prompt_logprobs is not None, "prompt_logprobs")):
        _check(
            not scored or prompts is None or len(prompts) == 1,
            f"'{field}' takes one prompt, not a list of {len(prompts or ())}: send one "
            "request per prompt",
            field,
        )
    temperature = _number(data, "temperature", default["temperature"])
    _check(
        0 <= temperature <= MAX_TEMPERATURE,
        f"'temperature' must be in [0, {MAX_TEMPERATURE}], got {temperature}",
        "temperature",
    )
    top_p = _number(data, "top_p", default["top_p"])
    _check(0 < top_p <= 1, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(data, "top_k", (int,), default["top_k"])
    _check(top_k >= -1 and top_k != 0, f"'top_k' must be -1 or >= 1, got {top_k}", "top_k")
    logprobs = _parse_logprobs(data, config, chat)
    stream = _get(data, "stream", (bool,), False)
    _check(  # returned whole, as vLLM does, which refuses it with a stream too
        not (stream and prompt_logprobs is not None),
        "'prompt_logprobs' is not available with stream; echo with logprobs streams them",
        "prompt_logprobs",
    )
    _check(
        not (stream and (beam or (best_of or n) > n)),
        "streaming is not available with beam search or best_of > n",
        "stream",
    )
    stop = _get(data, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    _check(
        all(isinstance(s, str) and s for s in stop) and len(stop) <= config.max_stops,
        f"'stop' must be a non-empty string or a list of up to {config.max_stops} of them "
        "(--max-stops)",
        "stop",
    )
    stop_token_ids = _get(data, "stop_token_ids", (list,), [])
    _check(
        len(stop_token_ids) <= config.max_stops,
        f"'stop_token_ids' holds {len(stop_token_ids)} ids, more than {config.max_stops} "
        "(--max-stops)",
        "stop_token_ids",
    )
    try:
        params = SamplingParams(
            n=n,
            best_of=best_of if best_of is not None else (n if beam else None),
            use_beam_search=beam,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=_number(data, "min_p", default["min_p"]),
            repetition_penalty=_number(data, "repetition_penalty", default["repetition_penalty"]),
            presence_penalty=_number(data, "presence_penalty", 0.0),
            frequency_penalty=_number(data, "frequency_penalty", 0.0),
            max_tokens=max_tokens,
            ignore_eos=_get(data, "ignore_eos", (bool,), False),
            stop_token_ids=tuple(stop_token_ids),
            stop=tuple(stop),
            seed=_get(data, "seed", (int,)),
            logprobs=logprobs,
            prompt_logprobs=_scored_prompt(prompt_logprobs, echo, logprobs, max_tokens),
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
        prompts,
        messages,
        params,
        stream,
        logprobs,
        request_id,
        _include_usage(data, stream),
        echo,
        prompt_logprobs,
        tools,
    )


def _request_defaults(checkpoint: Mapping[str, float | int], beam: bool) -> dict[str, Any]:
    """Each sampling field's default: the checkpoint's where it sets one, else ours. Beam
    search draws nothing, so it keeps ours (temperature 0) but for ``max_tokens``."""
    if beam:
        return BUILTIN_DEFAULTS | {
            "temperature": 0.0,
            "max_tokens": checkpoint.get("max_tokens", 16),
        }
    return BUILTIN_DEFAULTS | dict(checkpoint)


def _max_tokens(data: dict, default: int) -> tuple[int, str]:
    """``max_completion_tokens`` (OpenAI's newer name), else ``max_tokens``, else
    ``default``; and the name the value came under."""
    name = (
        "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    )
    return _get(data, name, (int,), default), name


def _include_usage(data: dict, stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options.include_usage``);
    stream_options on a request that does not stream is refused, as OpenAI refuses it."""
    options = _get(data, "stream_options", (dict,), {})
    _check(
        stream or not options,
        "'stream_options' is only allowed with 'stream': true",
        "stream_options",
    )
    include, name = options.get("include_usage"), "stream_options.include_usage"
    _check(include is None or isinstance(include, bool), f"'{name}' must be a boolean", name)
    return bool(include)


@dataclass(slots=True)
class ParsedTokenize:
    """A validated /tokenize body, as vLLM takes it: a prompt, or chat messages."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(data: dict[str, Any], max_messages: int) -> ParsedTokenize:
    """Validate a /tokenize body; vLLM's defaults: special tokens added to a prompt, not to
    a chat (its template has them), and the generation prompt after the messages."""
    chat = data.get("messages") is not None
    prompt = None if chat else _get(data, "prompt", (str,))
    _check(chat or prompt is not None, "'prompt' or 'messages' is required", "prompt")
    return ParsedTokenize(
        _get(data, "model", (str,)),
        prompt,
        _parse_messages(data, max_messages) if chat else None,
        _get(data, "add_special_tokens", (bool,), not chat),
        _get(data, "add_generation_prompt", (bool,), True),
        _get(data, "return_token_strs", (bool,), False),
    )


def parse_detokenize(data: dict[str, Any]) -> tuple[str | None, list[int]]:
    """The model named (or None) and the token ids of a /detokenize body."""
    tokens = data.get("tokens")
    _check(_token_ids(tokens), "'tokens' must be a list of token ids", "tokens")
    return _get(data, "model", (str,)), tokens


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


def _parse_prompts(data: dict, max_prompts: int) -> list[Prompt]:
    """The prompts in OpenAI's four forms: a string, a list of token ids, or a list of
    either kind (a batch, each prompt answered on its own)."""
    prompt = data.get("prompt")
    _check(prompt is not None, "'prompt' is required", "prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        _check(len(prompt) > 0, "'prompt' must not be empty", "prompt")
        return [prompt]
    _check(
        isinstance(prompt, list)
        and (all(isinstance(p, str) for p in prompt) or all(map(_token_ids, prompt))),
        "'prompt' must be a string, a list of token ids, a list of strings, or a list of "
        "token-id lists",
        "prompt",
    )
    _check(
        1 <= len(prompt) <= max_prompts,
        f"'prompt' must hold 1 to {max_prompts} prompts, got {len(prompt)}",
        "prompt",
    )
    for i, p in enumerate(prompt):
        _check(len(p) > 0, f"'prompt[{i}]' must not be empty", f"prompt[{i}]")
    return prompt


def _token_ids(value: Any) -> bool:
    """Whether ``value`` is a (possibly empty) list of integers, true and false not among them."""
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _parse_messages(data: dict, max_messages: int) -> list[dict[str, str]]:
    messages = data.get("messages")
    _check(
        isinstance(messages, list) and len(messages) > 0,
        "'messages' must be a non-empty list",
        "messages",
    )
    _check(
        len(messages) <= max_messages,
        f"'messages' holds {len(messages)} messages, more than {max_messages} (--max-messages)",
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
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "min_tokens": (None, 0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
}


def _refuse_unsupported(data: dict) -> None:
    for name, harmless in _UNSUPPORTED.items():
        if name in data and data[name] not in harmless:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def _parse_logprobs(data: dict, config: ApiConfig, chat: bool) -> int | None:
    if chat:
        if not _get(data, "logprobs", (bool,), False):
            return None
        return _logprobs_count(data, "top_logprobs", config, 0)
    return _logprobs_count(data, "logprobs", config)


def _logprobs_count(
    data: dict, name: str, config: ApiConfig, default: int | None = None
) -> int | None:
    """A count of alternatives per token (``logprobs``, ``top_logprobs``, vLLM's
    ``prompt_logprobs``) within the configured limit, or ``default`` when absent."""
    value = _get(data, name, (int,), default)
    if value is not None:
        _check(
            0 <= value <= config.max_logprobs,
            f"'{name}' must be in [0, {config.max_logprobs}], got {value}",
            name,
        )
    return value


def _scored_prompt(
    prompt_logprobs: int | None, echo: bool, logprobs: int | None, max_tokens: int
) -> int | None:
    """Alternatives per prompt token the engine must score, or None: what the response
    shows as prompt_logprobs, and what echo shows with logprobs (or nothing generated)."""
    wanted = [prompt_logprobs] if prompt_logprobs is not None else []
    if echo and (logprobs is not None or max_tokens == 0):
        wanted.append(logprobs or 0)
    return max(wanted, default=None)
