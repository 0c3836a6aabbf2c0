"""Structured outputs as clients spell them -- OpenAI's ``response_format``, vLLM's
``structured_outputs`` object and its older ``guided_*`` fields -- each turned into one
``Grammar`` and checked by the grammar engine the executor compiles it with."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from pagedserve.grammar import Grammar, GrammarError, parse_grammar
from scheduler_svc.api.errors import APIError, require

ANY_OBJECT = '{"type": "object"}'
# vLLM's structured_outputs keys, each with the grammar it makes (see _from_vllm).
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {f"guided_{kind}": kind for kind in ("json", "regex", "choice", "grammar")}
# Options of vLLM's object that change nothing here: JSON is always written without
# optional whitespace.
_VLLM_HARMLESS = ("disable_any_whitespace", "disable_additional_properties")


def wants_grammar(data: dict[str, Any]) -> bool:
    """Whether the body may need the grammar engine: structured output in any spelling, or
    tools (cheap, unchecked)."""
    response_format = data.get("response_format")
    asks_format = isinstance(response_format, dict) and response_format.get("type") != "text"
    return (
        asks_format
        or data.get("structured_outputs") is not None
        or any(data.get(name) is not None for name in _GUIDED)
        or bool(data.get("tools"))  # a forced call has a grammar
    )


def load_engine() -> None:
    """Import the grammar engine (with torch, a few seconds the first time), if installed:
    call it off the event loop before the first structured request is parsed."""
    with contextlib.suppress(ImportError):
        import xgrammar  # noqa: F401


def parse_structured(data: dict[str, Any]) -> Grammar | None:
    """The one grammar the body asks for, checked; None when it asks for none. Raises
    APIError(400) naming the field for a malformed or uncompilable one, or for two."""
    found = [
        (name, grammar)
        for name, grammar in (
            ("response_format", _from_response_format(data.get("response_format"))),
            ("structured_outputs", _from_vllm(data.get("structured_outputs"))),
            *((name, _from_guided(name, data.get(name))) for name in _GUIDED),
        )
        if grammar is not None
    ]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(
            400, f"only one structured output may be asked for, got {names}", param=found[1][0]
        )
    if not found:
        return None
    _, (grammar, param) = found[0]
    check_compiles(grammar, param)
    return grammar


def _from_response_format(value: Any) -> tuple[Grammar, str] | None:
    if value is None:
        return None
    require(isinstance(value, dict), "'response_format' must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_schema", ANY_OBJECT), "response_format"
    require(
        kind == "json_schema",
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format.type",
    )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    require(isinstance(spec, dict), f"'{param}' must be an object", param)
    require(isinstance(spec.get("name"), str), f"'{param}.name' must be a string", f"{param}.name")
    schema = spec.get("schema", {"type": "object"})
    require(isinstance(schema, dict), f"'{param}.schema' must be an object", f"{param}.schema")
    return Grammar("json_schema", json.dumps(schema)), f"{param}.schema"


def _from_vllm(value: Any) -> tuple[Grammar, str] | None:
    if value is None:
        return None
    param = "structured_outputs"
    require(isinstance(value, dict), f"'{param}' must be an object", param)
    for key in value:
        require(
            key in _VLLM_KINDS or key in _VLLM_HARMLESS,
            f"'{param}.{key}' is not supported; use one of {', '.join(_VLLM_KINDS)}",
            f"{param}.{key}",
        )
    kinds = [key for key in _VLLM_KINDS if value.get(key) is not None]
    require(len(kinds) == 1, f"'{param}' must hold exactly one of {', '.join(_VLLM_KINDS)}", param)
    kind = kinds[0]
    if kind == "json_object":
        return Grammar("json_schema", ANY_OBJECT), f"{param}.json_object"
    return _grammar_of(kind, value[kind], f"{param}.{kind}")


def _from_guided(name: str, value: Any) -> tuple[Grammar, str] | None:
    return None if value is None else _grammar_of(_GUIDED[name], value, name)


def _grammar_of(kind: str, value: Any, param: str) -> tuple[Grammar, str]:
    """vLLM's forms: a schema (object or JSON text), a regex, a choice list, an EBNF grammar."""
    if kind == "json":
        require(isinstance(value, dict | str), f"'{param}' must be a JSON schema", param)
        return Grammar("json_schema", value if isinstance(value, str) else json.dumps(value)), param
    if kind == "choice":
        require(
            isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
            f"'{param}' must be a non-empty list of non-empty strings",
            param,
        )
        return Grammar("ebnf", choice_grammar(value)), param
    require(isinstance(value, str) and value, f"'{param}' must be a non-empty string", param)
    return Grammar("regex" if kind == "regex" else "ebnf", value), param


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``; each is a string literal whose
    quotes, backslashes and control characters are escaped as in JSON."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_compiles(grammar: Grammar, param: str) -> None:
    """Parse the grammar as the executor will before compiling it against its vocabulary,
    so that a bad one is a 400 naming its field before the request is queued. A scheduler
    without the engine (its image has no torch, which the engine needs) leaves the check to
    the executor, whose refusal ends the request with a 400 ``invalid_grammar``."""
    try:
        parse_grammar(grammar)
    except GrammarError as e:
        raise APIError(400, f"'{param}' does not compile: {e}", param=param) from None
    except ImportError:
        pass
