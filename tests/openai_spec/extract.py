"""Writes components.json: the parts of OpenAI's OpenAPI document that our responses must
match, and everything they reference, for the conformance tests to read offline.

    python -m tests.openai_spec.extract openapi.json[.gz]

The document is github.com/openai/openai-openapi (MIT). Prose (descriptions, examples)
is dropped, references point into ``$defs``, and OpenAPI 3.0's ``nullable: true``, which
the 3.1 document still uses in places, becomes the ``null`` alternative it means.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ListModelsResponse",
    "ErrorResponse",
)
PROSE = {"description", "example", "examples", "title", "x-oaiMeta", "deprecated"}
OUT = Path(__file__).with_name("components.json")


def _clean(node: Any) -> Any:
    if isinstance(node, list):
        return [_clean(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _clean(v) for k, v in node.items() if k not in PROSE and k != "nullable"}
    if isinstance(node.get("properties"), dict):  # names of fields, never prose
        out["properties"] = {k: _clean(v) for k, v in node["properties"].items()}
    if "$ref" in out:
        out["$ref"] = out["$ref"].replace("#/components/schemas/", "#/$defs/")
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_refs, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].rsplit("/", 1)[1]} if "$ref" in node else set()
    return found.union(*map(_refs, node.values())) if node else found


def extract(document: dict[str, Any]) -> dict[str, Any]:
    """The ROOTS and their references, as one JSON Schema document of ``$defs``."""
    schemas, wanted, todo = document["components"]["schemas"], {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted[name] = _clean(schemas[name])
            todo.extend(_refs(schemas[name]))
    info = document["info"]
    return {
        "$comment": (
            f"Extracted by tests/openai_spec/extract.py from OpenAI's OpenAPI document "
            f"(github.com/openai/openai-openapi, version {info['version']}), "
            f"licence {info['license']['name']}, copyright OpenAI."
        ),
        "$defs": dict(sorted(wanted.items())),
    }


def main(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        document = json.load(f)
    OUT.write_text(json.dumps(extract(document), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
