"""Tool plans without a server: what the model is shown, the schema a forced call must
match, and an answer read back as a call only when it is exactly one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema

from scheduler_svc.api.tools import parse_tools

SUM = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": SUM}},
    {"type": "function", "function": {"name": "now"}},
]


def test_auto_reads_an_answer_as_a_call_only_when_it_is_exactly_one() -> None:
    plan = parse_tools({"tools": TOOLS})
    assert plan is not None and plan.choice == "auto" and plan.grammar() is None
    [call] = plan.calls('{"name": "add", "arguments": {"a": 2}}')
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'}
    for text in ('{"name": "sub", "arguments": {}}', "The answer is 4.", '{"name": "add"}'):
        assert plan.calls(text) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None


def test_a_forced_call_matches_its_functions_parameters() -> None:
    named = parse_tools(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    )
    schema = json.loads(named.grammar().spec)
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, schema)
    for wrong in ({"name": "now", "arguments": {}}, {"name": "add", "arguments": {}}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(wrong)
    either = json.loads(parse_tools({"tools": TOOLS, "tool_choice": "required"}).grammar().spec)
    jsonschema.validate({"name": "now", "arguments": {}}, either)


def test_functions_go_in_the_system_message_unless_the_template_has_a_tool_section() -> None:
    plan = parse_tools({"tools": TOOLS})
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    user = {"role": "user", "content": "hi"}
    messages, extra = plan.prompt(plain, [user])
    assert extra == {} and messages[0]["role"] == "system" and '"add"' in messages[0]["content"]
    messages, _ = plan.prompt(plain, [{"role": "system", "content": "Be brief."}, user])
    assert messages[0]["content"].startswith("Be brief.\n\n") and len(messages) == 2
    with_tools = SimpleNamespace(chat_template="{% if tools %}{{ tools }}{% endif %}")
    messages, extra = plan.prompt(with_tools, [user])
    assert messages == [user] and [t["function"]["name"] for t in extra["tools"]] == ["add", "now"]
