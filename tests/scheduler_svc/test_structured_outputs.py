"""Structured outputs and tool calls over real servers: every output of a JSON schema, a
regex or a choice list matches it, and every forced tool call's arguments validate, sampled
(n = 4, temperature 1) and streamed, whatever the model would say.

Most tests run on the shared guarded server, whose tiny random model writes noise: only the
grammar's mask can make its output valid. The default model (SmolLM2-135M) gets one server
of its own for the official client's ``parse`` and sampled JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.services import GUARD_KEY, serve

AUTH = {"Authorization": f"Bearer {GUARD_KEY}"}
PERSON = {  # nested objects, an array, an enum, required fields, bounded lengths
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "colour", "address", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLED = {"n": 4, "temperature": 1.0, "max_tokens": 160}


def chat(server: SimpleNamespace, **fields: object) -> dict:
    body = {"model": server.model, "messages": MESSAGES, **fields}
    r = server.client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def contents(body: dict) -> list[str]:
    return [choice["message"]["content"] for choice in body["choices"]]


def streamed_texts(server: SimpleNamespace, path: str, body: dict) -> list[str]:
    texts = [""] * body.get("n", 1)
    with server.client.stream("POST", path, json=body, headers=AUTH) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    texts[choice["index"]] += delta
    return texts


def test_every_sampled_output_validates_against_a_nested_schema(guarded_server) -> None:
    body = chat(guarded_server, response_format=PERSON_FORMAT, **SAMPLED)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert len(set(contents(body))) > 1  # sampled, not one forced answer


def test_regex_choice_and_grammar_in_every_spelling(guarded_server) -> None:
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    for fields in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        for output in contents(chat(guarded_server, **fields, **SAMPLED)):
            assert re.fullmatch(regex, output), output
    choices = ["yes", "no", 'a "quoted" maybe']
    for fields in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        assert set(contents(chat(guarded_server, **fields, **SAMPLED))) <= set(choices)
    grammar = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'
    sums = chat(guarded_server, structured_outputs={"grammar": grammar}, **SAMPLED)
    for output in contents(sums):
        assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", output), output
    schema_text = json.dumps(PERSON)
    for output in contents(chat(guarded_server, guided_json=schema_text, **SAMPLED)):
        jsonschema.validate(json.loads(output), PERSON)


def test_streamed_outputs_validate_on_both_endpoints(guarded_server) -> None:
    server = guarded_server
    base = {"model": server.model, "stream": True, **SAMPLED}
    chats = streamed_texts(
        server,
        "/v1/chat/completions",
        base | {"messages": MESSAGES, "response_format": PERSON_FORMAT},
    )
    completions = streamed_texts(
        server, "/v1/completions", base | {"prompt": "JSON:", "response_format": PERSON_FORMAT}
    )
    for text in chats + completions:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_regex": "(?=lookahead)x"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "use_beam_search"),
    ],
)
def test_a_bad_structured_output_is_a_400_naming_its_field(guarded_server, fields, param) -> None:
    server = guarded_server
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, **fields}
    r = server.client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    chat(server, max_tokens=2)  # still serving


class Address(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    addresses: list[Address] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir: Path) -> Iterator[SimpleNamespace]:
    """`pagedserve serve` on the default model, with the official client pointed at it."""
    with serve(smollm2_dir, "--num-gpu-blocks", "256", "--executor-metrics-port", "0") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        yield SimpleNamespace(url=url, client=client, model=client.models.list().data[0].id)


def test_the_official_clients_parse_returns_the_pydantic_object(smollm2_server) -> None:
    server = smollm2_server
    completion = server.client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "Invent a person with an address, as JSON."}],
        response_format=Person,
        max_tokens=160,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.addresses
    sampled = server.client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=PERSON_FORMAT,
        **SAMPLED,
    )
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # Any object has no bound on its length: a sample that rambles on inside it is cut at
    # max_tokens ("length"), as OpenAI's are; every one that ends is an object.
    objects = server.client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        **SAMPLED | {"max_tokens": 300},
    )
    ended = [c.message.content for c in objects.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
SUM = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": SUM}},
]
PARAMETERS = {"weather": WEATHER, "add": SUM}


def check_call(call: dict, names: set[str]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in names
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, PARAMETERS[call["function"]["name"]])


def test_forced_tool_calls_always_validate_whole_and_streamed(guarded_server) -> None:
    server = guarded_server
    named = {"type": "function", "function": {"name": "add"}}
    for choice, names in (("required", {"weather", "add"}), (named, {"add"})):
        body = chat(server, tools=TOOLS, tool_choice=choice, **SAMPLED)
        for c in body["choices"]:
            assert c["finish_reason"] == "tool_calls", c
            assert c["message"]["content"] is None and len(c["message"]["tool_calls"]) == 1
            check_call(c["message"]["tool_calls"][0], names)
    body = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "stream": True}
    calls, finishes = {}, {}
    with server.client.stream(
        "POST",
        "/v1/chat/completions",
        json=body | {"tool_choice": "required"} | SAMPLED,
        headers=AUTH,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    assert not c["delta"].get("content"), c  # a call is never sent as text
                    for call in c["delta"].get("tool_calls") or []:
                        calls[c["index"]] = call
                    finishes[c["index"]] = c["finish_reason"] or finishes.get(c["index"])
    assert sorted(calls) == [0, 1, 2, 3] and set(finishes.values()) == {"tool_calls"}
    for call in calls.values():
        check_call(call, {"weather", "add"})


def test_the_official_client_reads_calls_and_sends_the_history_back(guarded_server) -> None:
    """tool_calls through the openai client; its next request carries the assistant's call
    (content null) and the tool's answer (role "tool"); "auto" lets the model answer in text
    (the random model does not write a call) and "none" offers no tools."""
    server = guarded_server
    client = OpenAI(base_url=f"{server.url}/v1", api_key=GUARD_KEY)
    first = client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    history = [*MESSAGES, message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "21 degrees"})
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(
            model=server.model, messages=history, tools=TOOLS, tool_choice=choice, max_tokens=8
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert isinstance(answer.choices[0].message.content, str)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "nonsense"}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(guarded_server, fields, param) -> None:
    server = guarded_server
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, **fields}
    r = server.client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = server.client.post(
        "/v1/completions", json={"model": server.model, "prompt": "x", "tools": TOOLS}, headers=AUTH
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
