"""Typed models of the HTTP API's bodies, for /openapi.json and /docs. They describe;
protocol.py validates (on the raw bytes, within the size limit, naming each field), so a
request costs no second validation."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="end the stream with a usage chunk")


class Sampling(BaseModel):
    """Fields both completion endpoints take."""

    model: str
    max_tokens: int = Field(16, ge=0, description="0 only with echo or prompt_logprobs")
    max_completion_tokens: int | None = Field(None, ge=0, description="wins over max_tokens")
    temperature: float = Field(1.0, ge=0, le=2, description="below 1e-5 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 (off) or >= 1")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=2)
    n: int = Field(1, ge=1, description="choices per prompt, up to --max-n")
    best_of: int | None = Field(None, description=">= n; the n best are returned")
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10, le=10)
    stop: str | list[str] | None = Field(None, description="up to 16 strings")
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = Field(None, description="signed 64-bit")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream")
    request_id: str | None = Field(None, description="or the X-Request-Id header")
    priority: int = Field(0, description="lower runs first")
    timeout: float | None = Field(None, description="seconds; or X-Request-Timeout")
    user: str | None = Field(None, description="accepted, ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted, ignored")
    store: bool | None = Field(None, description="accepted, ignored")
    service_tier: str | None = Field(None, description="accepted, ignored")
    prompt_logprobs: int | None = Field(
        None, ge=0, description="vLLM's: alternatives per prompt token; one prompt, no stream"
    )
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema: a grammar masks every token"
    )
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="older vLLM spelling")
    guided_regex: str | None = Field(None, description="older vLLM spelling")
    guided_choice: list[str] | None = Field(None, description="older vLLM spelling")
    guided_grammar: str | None = Field(None, description="older vLLM spelling (EBNF)")


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="one prompt, or a list of them answered with n choices each"
    )
    logprobs: int | None = Field(None, ge=0, description="alternatives per token")
    echo: bool = Field(False, description="the prompt before the completion; one prompt")
    tools: list[dict[str, Any]] | None = Field(None, description="chat only: a 400 here")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] = Field(description="text parts are joined by newlines")


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0)
    echo: bool = Field(False, description="completions only: true is a 400 here")
    tools: list[dict[str, Any]] | None = Field(None, description="functions the model may call")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default), required, or a named function"
    )


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = Field(None, description="this, or messages")
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt")
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = Field(description="i * n + j: sample j of prompt i")
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="with prompt_logprobs, as vLLM shapes them"
    )


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage


class CompletionResponse(_Response):
    """Also the shape of each streamed chunk (without usage, but for the last with
    stream_options.include_usage)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="with prompt_logprobs, as vLLM shapes them"
    )


class ModelCardBody(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCardBody]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="the field at fault")
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# route: (request model or None, response model)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel]]] = {
    ("post", "/v1/completions"): (CompletionRequest, CompletionResponse),
    ("post", "/v1/chat/completions"): (ChatCompletionRequest, ChatCompletionResponse),
    ("get", "/v1/models"): (None, ModelList),
    ("get", "/v1/models/{model}"): (None, ModelCardBody),
    ("post", "/tokenize"): (TokenizeRequest, TokenizeResponse),
    ("post", "/detokenize"): (DetokenizeRequest, DetokenizeResponse),
    ("get", "/version"): (None, VersionResponse),
}


def describe(app: FastAPI) -> None:
    """Make the app's OpenAPI document carry ROUTES' models: each route's request body,
    its 200 answer and, for every route, the OpenAI error."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = {m for pair in ROUTES.values() for m in pair if m is not None}
            _, schemas = models_json_schema(
                [(m, "validation") for m in (*models, ErrorResponse)],
                ref_template="#/components/schemas/{model}",
            )
            document.setdefault("components", {}).setdefault("schemas", {})
            document["components"]["schemas"].update(schemas["$defs"])
            for (method, path), (body, answer) in ROUTES.items():
                _describe_operation(document["paths"][path][method], body, answer)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _describe_operation(
    operation: dict[str, Any], body: type[BaseModel] | None, answer: type[BaseModel]
) -> None:
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _ref(body)}
    error = {
        "description": "an OpenAI-style error naming the field",
        "content": _ref(ErrorResponse),
    }
    operation["responses"] = {
        "200": {"description": "OK", "content": _ref(answer)},
        "4XX": error,
        "5XX": error,
    }
