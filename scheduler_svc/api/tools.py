"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` as a prompt the model reads, a grammar
its call must match, and its output read back as ``tool_calls``.

A call is written as one JSON object, ``{"name": NAME, "arguments": {...}}``. With
``tool_choice`` ``"required"`` or a named function that object is forced by a JSON schema
built from the functions' ``parameters``, so its arguments always validate; with ``"auto"``
the model may write one or answer in text, and an answer that is exactly such an object
naming a known function is read as a call. When the chat template has no tool section (the
default model's has none) the functions and that format are described in a system message.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from pagedserve.grammar import Grammar
from scheduler_svc.api.errors import require

TOOLS_PROMPT = (
    "You can call these functions:\n{functions}\n"
    'To call one, answer with only a JSON object: {{"name": <function name>, '
    '"arguments": <its arguments as a JSON object>}}.'
)


@dataclass(slots=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` ask for."""

    functions: list[dict[str, Any]]  # OpenAI's function objects: name, description, parameters
    choice: str  # "auto", "required", or "named" (only ``named`` may be called)
    named: str | None = None

    def grammar(self) -> Grammar | None:
        """The schema a forced call must match; None when the model may answer in text."""
        if self.choice == "auto":
            return None
        allowed = [f for f in self.functions if self.named in (None, f["name"])]
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return Grammar("json_schema", json.dumps(schema))

    def system_message(self) -> str:
        described = [
            {k: f[k] for k in ("name", "description", "parameters") if k in f}
            for f in self.functions
        ]
        return TOOLS_PROMPT.format(functions="\n".join(json.dumps(f) for f in described))

    def prompt(
        self, tokenizer: Any, messages: list[dict[str, str]]
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """The messages and chat-template arguments that show the model its functions: the
        template's own tool section when it has one, else a system message."""
        if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
            return messages, {
                "tools": [{"type": "function", "function": f} for f in self.functions]
            }
        text = self.system_message()
        if messages and messages[0]["role"] == "system":
            first = messages[0] | {"content": f"{messages[0]['content']}\n\n{text}"}
            return [first, *messages[1:]], {}
        return [{"role": "system", "content": text}, *messages], {}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """``text`` as OpenAI's ``tool_calls`` (one call), or None when it is not a call."""
        try:
            call = json.loads(text)
        except ValueError:
            return None
        names = {f["name"] for f in self.functions}
        if not (
            isinstance(call, dict)
            and call.keys() == {"name", "arguments"}
            and call["name"] in names
            and isinstance(call["arguments"], dict)
        ):
            return None
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        return [{"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}]


def calls_as_text(tool_calls: Any, param: str) -> str:
    """An assistant message's ``tool_calls`` in the history, written as the model writes a
    call (one JSON object a line)."""
    require(isinstance(tool_calls, list) and tool_calls, f"'{param}' must be a list", param)
    lines = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(function, dict) and isinstance(function.get("name"), str)
        require(
            ok and isinstance(function.get("arguments"), str),
            f"'{param}[{i}].function' needs a name and arguments",
            f"{param}[{i}]",
        )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]
        lines.append(json.dumps({"name": function["name"], "arguments": arguments}))
    return "\n".join(lines)


def parse_tools(data: dict[str, Any]) -> ToolPlan | None:
    """The request's plan, or None when it offers no tools or ``tool_choice`` is ``"none"``.
    Raises APIError(400) naming the field."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if not tools:
        require(choice in (None, "none"), "'tool_choice' needs 'tools'", "tool_choice")
        return None
    require(isinstance(tools, list), "'tools' must be a list", "tools")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if choice is None or choice in ("auto", "required"):
        return ToolPlan(functions, choice or "auto")
    if choice == "none":
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    require(
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(named, str),
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )
    require(
        named in {f["name"] for f in functions},
        f"'tool_choice' names {named!r}, which is not in 'tools'",
        "tool_choice",
    )
    return ToolPlan(functions, "named", named)


def _function(tool: Any, param: str) -> dict[str, Any]:
    require(
        isinstance(tool, dict) and tool.get("type") == "function",
        f'\'{param}\' must be {{"type": "function", "function": {{...}}}}',
        param,
    )
    function = tool.get("function")
    require(
        isinstance(function, dict), f"'{param}.function' must be an object", f"{param}.function"
    )
    require(
        isinstance(function.get("name"), str) and function["name"],
        f"'{param}.function.name' must be a non-empty string",
        f"{param}.function.name",
    )
    parameters = function.get("parameters")
    require(
        parameters is None or isinstance(parameters, dict),
        f"'{param}.function.parameters' must be a JSON schema object",
        f"{param}.function.parameters",
    )
    return function
