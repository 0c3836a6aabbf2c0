"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics,
and the live block map."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ApiConfig
from pagedserve.step import PromptLogprob
from scheduler_svc.api.admission import (
    ModelCard,
    check_executor,
    check_fits,
    check_model,
    tokenize_prompts,
)
from scheduler_svc.api.batch import merge, prompt_request_ids
from scheduler_svc.api.dashboard import Dashboard, add_dashboard_routes
from scheduler_svc.api.errors import APIError, client_error
from scheduler_svc.api.keys import ApiKeys
from scheduler_svc.api.protocol import ParsedRequest, check_request_id, parse_completion
from scheduler_svc.api.render import VERSION, Renderer
from scheduler_svc.api.schema import describe
from scheduler_svc.api.structured import load_engine, wants_grammar
from scheduler_svc.api.tokens import add_token_routes
from scheduler_svc.api.wire import decode_body, read_body
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.state.streams import Choice, RequestDelta

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer


class ClientGone(Exception):
    """The client closed its connection before the answer began."""


class Api:
    """Routes requests to the engine; every failure leaves as an OpenAI-style error."""

    def __init__(
        self, engine: AsyncEngine, tokenizer: Any, card: ModelCard, config: ApiConfig, keys: ApiKeys
    ) -> None:
        self.engine, self.tokenizer, self.card, self.config = engine, tokenizer, card, config
        self.keys = keys

    async def handle(self, request: Request, chat: bool) -> Response:
        """Answer one completion or chat request; any exception leaves as an APIError."""
        try:
            return await self._answer(request, chat)
        except ClientGone:  # its request is aborted; what is returned reaches no one
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise client_error(e, getattr(request.state, "request_id", None)) from None

    async def _answer(self, request: Request, chat: bool) -> Response:
        check_executor(self.engine, self.config)
        body = decode_body(await read_body(request, self.config.max_body_bytes))
        if wants_grammar(body):
            await asyncio.to_thread(load_engine)  # a few seconds once: not on the event loop
        parsed = parse_completion(
            body,
            self.config,
            chat,
            request.headers.get("x-request-timeout"),
            self.card.sampling_defaults,
        )
        if parsed.params.grammar is not None and self.tokenizer is None:
            raise APIError(400, "structured outputs need the model's tokenizer", param="model")
        check_model(self.card.name, parsed.model)
        prompts = tokenize_prompts(self.tokenizer, self.card.vocab_size, parsed)
        for ids in prompts:
            check_fits(self.engine, len(ids), parsed.params)
        request_id = _request_id(request, parsed, chat)
        request.state.request_id = request_id
        resume = _last_event(request.headers.get("last-event-id"), parsed.params)
        resumable = _resumable(request, resume, len(prompts))
        owner = request.scope.get("state", {}).get("owner", "")  # set by ApiKeyCheck
        deltas = self._generate(request_id, prompts, parsed, resume, owner)
        render = Renderer(self.card.name, self.tokenizer, parsed, request_id, prompts, chat)
        headers = {"X-Request-Id": request_id}
        if parsed.stream:
            first = await _first_unless_disconnected(request, deltas)
            stream = render.sse(first, deltas, resume, resumable)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        num_choices = len(prompts) * parsed.params.n
        choices, prompt_logprobs = await _collect_unless_disconnected(request, deltas, num_choices)
        return JSONResponse(render.final(choices, prompt_logprobs), headers=headers)

    def _generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        parsed: ParsedRequest,
        resume: tuple[int, int] | None,
        owner: str,
    ) -> AsyncIterator[RequestDelta]:
        """The engine's deltas of every prompt, as one stream (see batch.merge)."""
        after = resume[0] - 1 if resume else None  # the named event may have more outputs
        ids = prompt_request_ids(request_id, len(prompts))
        params = parsed.params
        streams = [
            self.engine.generate(i, p, params, after, owner, stream=parsed.stream)
            for i, p in zip(ids, prompts, strict=True)
        ]
        return merge(streams, params.n)


def _request_id(request: Request, parsed: ParsedRequest, chat: bool) -> str:
    """The client's id (the X-Request-Id header, else the body's request_id) or a new one."""
    header = check_request_id(request.headers.get("x-request-id") or None, "X-Request-Id")
    return header or parsed.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _resumable(request: Request, resume: tuple[int, int] | None, num_prompts: int) -> bool:
    """Whether the stream's events carry ids for Last-Event-ID: asked for with
    ``X-Resumable-Stream: true``, or a resume itself. By default a stream is what OpenAI
    sends, ``data:`` lines only, which every client's parser reads. An id counts the
    events of one engine request, so a prompt list cannot be resumed."""
    asked = request.headers.get("x-resumable-stream", "").strip().lower()
    resumable = resume is not None or asked in ("1", "true", "yes")
    if resumable and num_prompts > 1:
        raise APIError(
            400,
            "a resumable stream (X-Resumable-Stream, Last-Event-ID) takes one prompt",
            param="prompt",
        )
    return resumable


_LAST_EVENT = re.compile(r"([0-9]{1,10})\.([0-9]{1,10})")


def _last_event(value: str | None, params: SamplingParams) -> tuple[int, int] | None:
    """``Last-Event-ID: EVENT.OUTPUT`` of a reconnecting stream, or None. A request has at
    most max_tokens + 1 events (a token each, and the end) and n outputs: a resume past
    them is refused here rather than waited on."""
    if not value:
        return None
    match = _LAST_EVENT.fullmatch(value)
    event, output = (int(match[1]), int(match[2])) if match else (0, 0)
    if not (1 <= event <= params.max_tokens + 1 and output < params.n):
        raise APIError(
            400,
            f"Last-Event-ID must be EVENT.OUTPUT with EVENT in [1, {params.max_tokens + 1}] "
            f"and OUTPUT in [0, {params.n - 1}], got {value[:40]!r}",
            param="Last-Event-ID",
            code="event_out_of_range",
        )
    return event, output


async def _first_unless_disconnected(
    request: Request, deltas: AsyncIterator[RequestDelta]
) -> RequestDelta | None:
    """The first delta, awaited before the stream's 200 goes out: a refusal (a conflict,
    a resume of an unknown request) still leaves with its own status."""

    async def first() -> RequestDelta | None:
        return await anext(deltas, None)

    try:
        return await _unless_disconnected(request, first())
    except BaseException:
        await deltas.aclose()
        raise


async def _collect_unless_disconnected(
    request: Request, deltas: AsyncIterator[RequestDelta], num_choices: int
) -> tuple[list[Choice], list[PromptLogprob] | None]:
    """Accumulate every delta, and the prompt's scores when the first one carries them
    (a request that asks for them has one prompt); a client that goes away aborts it."""
    choices = [Choice() for _ in range(num_choices)]
    prompt_logprobs = None

    async def collect() -> None:
        nonlocal prompt_logprobs
        async for delta in deltas:
            prompt_logprobs = delta.prompt_logprobs or prompt_logprobs
            for out in delta.outputs:
                choices[out.index].add(out)

    try:
        await _unless_disconnected(request, collect())
    finally:
        await deltas.aclose()
    return choices, prompt_logprobs


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; ClientGone when the client goes away first (``work`` cancelled).
    The disconnect is awaited rather than polled, so a request that waits costs the event
    loop nothing."""

    async def disconnect() -> None:  # the body is read: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.create_task(work), asyncio.create_task(disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone
        return task.result()
    finally:  # both done before the caller closes the deltas the task was reading
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


# No API key: no request data behind them (/docs reads /openapi.json from the browser).
OPEN_PATHS = ("/health", "/dashboard", "/docs", "/openapi.json")
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class ApiKeyCheck:
    """Answers 401 to a request without an accepted API key, and records the key's owner
    in the request's state. Plain ASGI: starlette's BaseHTTPMiddleware wraps every receive
    in tasks, and each non-streaming request polls receive to notice a client that left."""

    def __init__(self, app: Any, api: Api) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            owner = self.api.keys.owner(dict(scope["headers"]).get(b"authorization", b""))
            if owner is None:
                error = APIError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    code="invalid_api_key",
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
            scope.setdefault("state", {})["owner"] = owner
            if scope["path"] in COMPLETION_PATHS:
                try:
                    held = self.api.keys.hold(owner)
                except APIError as e:
                    await _error_response(e)(scope, receive, send)
                    return
                with held:  # until the whole answer, a stream's last event too, is sent
                    await self.app(scope, receive, send)
                return
        await self.app(scope, receive, send)


RETRY_AFTER_S = {503: "5", 429: "2"}  # what a refused client waits before trying again


def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S[e.status]} if e.status in RETRY_AFTER_S else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(api: Api, metrics: Any | None = None, dashboard: Dashboard | None = None) -> FastAPI:
    """The FastAPI application; ``metrics`` renders /metrics (Prometheus text),
    ``dashboard`` serves the block map at /dashboard."""
    app = FastAPI(title="pagedserve", version=VERSION, docs_url="/docs", redoc_url=None)
    describe(app)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)  # anything else: logged, and a JSON 500
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return _error_response(client_error(e, getattr(request.state, "request_id", None)))

    app.add_middleware(ApiKeyCheck, api=api)

    @app.get("/health")
    async def health() -> Response:
        if api.engine.is_running:
            engine = api.engine
            return JSONResponse(
                {"status": "ok", "leading": engine.leading, "executors": sorted(engine.lanes)}
            )
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    card = {
        "id": api.card.name,
        "object": "model",
        "created": 0,
        "owned_by": "pagedserve",
        "max_model_len": api.card.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")  # a model's name may be a path
    async def model(model: str) -> dict[str, Any]:
        check_model(api.card.name, model)
        return card

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.handle(request, chat=True)

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics() if metrics is not None else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    add_token_routes(app, api.tokenizer, api.card, api.config)
    if dashboard is not None:
        add_dashboard_routes(app, dashboard)
    return app
