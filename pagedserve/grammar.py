"""What a structured output must match, and its parse by the grammar engine (xgrammar),
the same in the scheduler (which checks a request's grammar) and the executor (which
compiles it against the vocabulary)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
_ENGINE_PREFIX = re.compile(r"^(\[[\d:]+\] \S+:\d+: )+")  # "[09:12:49] /project/x.cc:94: "


class GrammarError(ValueError):
    """A grammar the engine cannot parse; the message is the engine's first line."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A JSON schema, a regular expression or an EBNF grammar (xgrammar's dialect), as
    text. Every structured output form of the API (``response_format``, a choice list,
    ...) comes down to one."""

    kind: str  # one of GRAMMAR_KINDS
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"kind must be one of {GRAMMAR_KINDS}, got {self.kind[:40]!r}")


def parse_grammar(grammar: Grammar) -> Any:
    """The engine's ``xgrammar.Grammar``. JSON is compact: no optional whitespace, which
    keeps a small model from padding its output with blanks. Raises GrammarError.

    The engine (and torch with it) is imported on the first call: a few seconds.
    """
    import xgrammar as xgr

    try:
        if grammar.kind == "json_schema":
            return xgr.Grammar.from_json_schema(
                grammar.spec, any_whitespace=False, separators=(",", ":")
            )
        if grammar.kind == "regex":
            return xgr.Grammar.from_regex(grammar.spec)
        return xgr.Grammar.from_ebnf(grammar.spec)
    except RuntimeError as e:
        raise GrammarError(_ENGINE_PREFIX.sub("", str(e).strip().split("\n")[0])) from None
