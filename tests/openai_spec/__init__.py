"""OpenAI's published response schemas (components.json, written by extract.py) as test
assertions: a body that does not validate fails with every reason listed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

DEFS: dict[str, Any] = json.loads(Path(__file__).with_name("components.json").read_text())["$defs"]


def _completion_chunk() -> dict[str, Any]:
    """A streamed completion chunk. The document gives completions one shape for whole
    responses and chunks, with a finish_reason that is never null; OpenAI's own streams
    (and every client that reads them) carry ``null`` until a choice ends."""
    schema = copy.deepcopy(DEFS["CreateCompletionResponse"])
    choice = schema["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return schema


_VALIDATORS = {
    name: Draft202012Validator(schema | {"$defs": DEFS})
    for name, schema in (DEFS | {"CompletionStreamChunk": _completion_chunk()}).items()
}


def assert_conforms(component: str, body: Any) -> None:
    """Fail unless ``body`` validates against OpenAI's ``component`` (or
    "CompletionStreamChunk", a streamed completion chunk)."""
    errors = sorted(_VALIDATORS[component].iter_errors(body), key=lambda e: list(e.path))
    reasons = "\n".join(f"  at {list(e.path)}: {e.message[:300]}" for e in errors)
    assert not errors, f"not a conforming {component}:\n{reasons}\nbody: {str(body)[:1500]}"
