"""JSON on the wire: a request body read within its size limit and checked whole before any
field is read; response JSON that never carries NaN or an infinity."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.requests import Request

from scheduler_svc.api.errors import APIError

MAX_JSON_DEPTH = 64  # nesting levels of a request body; OpenAI's own bodies use under 10
LOGPROB_FLOOR = -9999.0  # how a logprob of -inf (or NaN) is shown, as vLLM shows it
_ALWAYS_VALID = {int, bool, type(None)}  # JSON values with nothing to check
_SURROGATE = re.compile("[\ud800-\udfff]")  # a valid pair decodes to one code point


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it grows past ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413,
                f"request body exceeds the limit of {limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in ``body``; APIError(400) for anything a field must never hold."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of thousands of digits
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_values(data)
    return data


def _check_values(data: dict[str, Any]) -> None:
    """Refuse, naming the field, a string (or key) that is not valid Unicode (a lone
    surrogate, which no store or encoder takes), a number that is NaN or infinite (JSON
    has neither, Python's parser reads them), and nesting past MAX_JSON_DEPTH.

    Every value is visited, whether or not a parser reads its field, so no field added
    later escapes. Iterative: a body can nest as deep as the interpreter's stack.
    """
    stack: list[tuple[str, dict | list, int]] = [("", data, 1)]
    while stack:
        path, node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(node, list) and set(map(type, node)) <= _ALWAYS_VALID:
            continue  # a list of token ids, at C speed
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                where = f"'{path}'" if path else "the body"
                raise APIError(400, f"a key in {where} is not valid Unicode", param=path or None)
            if isinstance(value, (dict, list)):
                stack.append((_child(path, key), value, depth + 1))
            elif isinstance(value, str) and _SURROGATE.search(value):
                field = _child(path, key)
                message = f"'{field}' is not valid Unicode (it holds a lone surrogate)"
                raise APIError(400, message, param=field)
            elif isinstance(value, float) and not math.isfinite(value):
                field = _child(path, key)
                raise APIError(400, f"'{field}' must be a finite number", param=field)


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _too_deep() -> APIError:
    return APIError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="too_deep")


def to_json(payload: dict[str, Any]) -> str:
    """``payload`` as JSON; ValueError rather than NaN or Infinity, which JSON lacks."""
    return json.dumps(payload, allow_nan=False)


def finite_logprob(value: float) -> float:
    """``value`` when finite; LOGPROB_FLOOR for -inf or NaN, 0 for +inf."""
    if math.isfinite(value):
        return value
    return 0.0 if value > 0 else LOGPROB_FLOOR
