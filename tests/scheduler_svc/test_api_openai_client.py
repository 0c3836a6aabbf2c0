"""The official `openai` client against the shared guarded server, every answer checked
against OpenAI's schema: models, completions of one prompt and of a prompt list, chat
whole and streamed (with a usage chunk), the newer field names, and refusals it raises
as BadRequestError naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
from openai import OpenAI

from tests.openai_spec import assert_conforms
from tests.services import GUARD_KEY

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(guarded_server: SimpleNamespace) -> OpenAI:
    return OpenAI(base_url=f"{guarded_server.url}/v1", api_key=GUARD_KEY, max_retries=0)


def test_models(client: OpenAI, guarded_server: SimpleNamespace) -> None:
    page = client.models.list()
    assert_conforms("ListModelsResponse", page.model_dump(exclude_unset=True))
    assert [m.id for m in page.data] == [guarded_server.model]
    one = client.models.retrieve(guarded_server.model)
    assert_conforms("Model", one.model_dump(exclude_unset=True))
    assert one.id == guarded_server.model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


def test_completions_of_one_prompt_and_of_a_list(client, guarded_server) -> None:
    kw = {"model": guarded_server.model, "max_tokens": 4, "temperature": 0}
    one = client.completions.create(prompt="The harbour", **kw)
    assert_conforms("CreateCompletionResponse", one.model_dump(exclude_unset=True))
    many = client.completions.create(prompt=["The harbour", "A letter"], n=2, **kw)
    assert_conforms("CreateCompletionResponse", many.model_dump(exclude_unset=True))
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.usage.completion_tokens == 4 * 4


def test_chat_whole_and_streamed(client, guarded_server) -> None:
    kw = {"model": guarded_server.model, "messages": MESSAGES, "temperature": 0}
    whole = client.chat.completions.create(max_completion_tokens=5, user="u", **kw)
    assert_conforms("CreateChatCompletionResponse", whole.model_dump(exclude_unset=True))
    assert whole.usage.completion_tokens <= 5 and whole.choices[0].message.refusal is None
    chunks = list(
        client.chat.completions.create(
            max_completion_tokens=5, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    for chunk in chunks:
        assert_conforms("CreateChatCompletionStreamResponse", chunk.model_dump(exclude_unset=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


REFUSED = [
    ({"suffix": "!"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
    ({"prompt": ["x", [1, 2]]}, "prompt"),
]


@pytest.mark.parametrize(("kw", "param"), REFUSED)
def test_refusals_name_the_field(client, guarded_server, kw, param) -> None:
    kw = {"model": guarded_server.model, "prompt": "x", "max_tokens": 1} | kw
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw)
    assert info.value.param == param
