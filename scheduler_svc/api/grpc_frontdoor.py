"""The gRPC front door: FrontDoor.Generate and Abort over the AsyncEngine, pb at the edge."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from pagedserve.rpc import GRPC_OPTIONS
from pagedserve.rpc.tls import add_port
from pagedserve.rpc.v1 import frontdoor_pb2 as pb
from pagedserve.rpc.v1 import frontdoor_pb2_grpc
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import ApiConfig
from scheduler_svc.api.admission import (
    ModelCard,
    check_executor,
    check_fits,
    tokenize_prompts,
)
from scheduler_svc.api.errors import APIError, client_error
from scheduler_svc.api.grpc_gate import Gate, call_authorization
from scheduler_svc.api.keys import ApiKeys
from scheduler_svc.api.protocol import parse_completion
from scheduler_svc.api.wire import finite_logprob
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.state.streams import RequestDelta, SeqDelta

log = structlog.get_logger(__name__)

# Optional scalar fields that mean the same as the OpenAI body field of the same name.
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "best_of",
    "logprobs",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "length_penalty",
)
_STATUS_CODES = {
    409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def request_to_body(request: pb.GenerateRequest, model: str) -> dict[str, Any]:
    """The request as the OpenAI body that protocol.py validates: one rule set for both doors.

    Unset optional fields stay out of the body, so the HTTP defaults apply.
    """
    body: dict[str, Any] = {
        "model": model,
        "use_beam_search": request.use_beam_search,
        "ignore_eos": request.ignore_eos,
        "stop": list(request.stop),
        "stop_token_ids": list(request.stop_token_ids),
    }
    if request.request_id:
        body["request_id"] = request.request_id
    kind = request.WhichOneof("prompt")
    if kind == "text":
        body["prompt"] = request.text
    elif kind == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    body.update(
        {name: getattr(request, name) for name in _OPTIONAL_FIELDS if request.HasField(name)}
    )
    return body


def _status_code(status: int) -> grpc.StatusCode:
    """The gRPC status that says what an APIError's HTTP status says."""
    if status in _STATUS_CODES:
        return _STATUS_CODES[status]
    return grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.INVALID_ARGUMENT


def _message(e: APIError) -> str:
    """The error text, led by the field's name when the text does not already say it."""
    if e.param is None or e.param in e.message:
        return e.message
    return f"{e.param}: {e.message}"


class _Reply:
    """Shapes one request's deltas as GenerateResponses and counts tokens for the usage."""

    def __init__(self, request_id: str, prompt_len: int, tokenizer: Any) -> None:
        self.request_id, self.prompt_len, self.tokenizer = request_id, prompt_len, tokenizer
        self.num_completion_tokens = 0

    def response(self, delta: RequestDelta) -> pb.GenerateResponse:
        out = pb.GenerateResponse(request_id=self.request_id)
        for seq in delta.outputs:
            self.num_completion_tokens += len(seq.token_ids)
            out.choices.append(self._choice(seq))
        if delta.finished:
            out.usage.CopyFrom(self._usage())
        return out

    def _choice(self, seq: SeqDelta) -> pb.CompletionDelta:
        tops = [
            pb.CompletionTopLogprobs(
                entries=[
                    pb.CompletionLogprob(
                        token_id=token_id, text=self.tokenizer.decode([token_id]), logprob=lp
                    )
                    for token_id, lp in sorted(_finite(top).items(), key=lambda kv: -kv[1])
                ]
            )
            for top in seq.top_logprobs
        ]
        return pb.CompletionDelta(
            index=seq.index,
            text=seq.text,
            token_ids=seq.token_ids,
            logprobs=[finite_logprob(lp) for lp in seq.logprobs],
            top_logprobs=tops,
            finish_reason=_FINISH_REASONS.get(seq.finish_reason or "", 0),
        )

    def _usage(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_len, completion_tokens=self.num_completion_tokens)


def _finite(top: dict[int, float]) -> dict[int, float]:
    return {token_id: finite_logprob(lp) for token_id, lp in top.items()}


class FrontDoorServicer(frontdoor_pb2_grpc.FrontDoorServicer):
    """Serves FrontDoor under grpc.aio with the HTTP door's validation and limits.

    Bad input is refused with INVALID_ARGUMENT before the engine sees the request; an
    aborted request's stream ends with finish reason ABORT (the engine sends that event).
    The API key and well-formed messages are checked before a method runs (grpc_gate.Gate).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        card: ModelCard,
        config: ApiConfig | None = None,
        keys: ApiKeys | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.card = engine, tokenizer, card
        self.config = config or ApiConfig()
        self.keys = keys or ApiKeys(())

    def owner(self, context: grpc.aio.ServicerContext) -> str:
        """Who the call's key belongs to (Gate has refused calls without an accepted one)."""
        return self.keys.owner(call_authorization(context.invocation_metadata())) or ""

    def validate(self, request: pb.GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        """Request id, prompt token ids and sampling params of a request that can run; raise
        APIError (503 while the executor is away past the budget, as HTTP does, else 400)."""
        check_executor(self.engine, self.config)
        body = request_to_body(request, self.card.name)
        parsed = parse_completion(body, self.config, False, defaults=self.card.sampling_defaults)
        (prompt_ids,) = tokenize_prompts(self.tokenizer, self.card.vocab_size, parsed)
        check_fits(self.engine, len(prompt_ids), parsed.params)
        return parsed.request_id or f"gen-{uuid.uuid4().hex}", prompt_ids, parsed.params

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one response per engine event; the last one carries the usage.

        A refusal or a failure ends the call with its status: INVALID_ARGUMENT for bad
        input, ALREADY_EXISTS for a request id in use or sent before with another body,
        UNAVAILABLE while the engine or the executor is away, INTERNAL for our own faults
        (logged). A client that cancels (or goes away) closes this generator, which aborts
        the request.
        """
        request_id, owner = None, self.owner(context)
        try:
            with self.keys.hold(owner):
                request_id, prompt_ids, params = self.validate(request)
                reply = _Reply(request_id, len(prompt_ids), self.tokenizer)
                deltas = self.engine.generate(request_id, prompt_ids, params, owner=owner)
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        yield reply.response(delta)
        except Exception as e:
            error = client_error(e, request_id)
            await context.abort(_status_code(error.status), _message(error))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Abort a request this caller may see (keys.owner_of says who that is);
        ``aborted`` says whether this door streamed it."""
        return pb.AbortResponse(aborted=self.engine.abort(request.request_id, self.owner(context)))


async def start_frontdoor(
    servicer: FrontDoorServicer,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> grpc.aio.Server:
    """Serve ``servicer`` on host:port (GRPC_OPTIONS message limits; TLS with
    ``credentials``); returns the started server."""
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[Gate(servicer.keys)])
    frontdoor_pb2_grpc.add_FrontDoorServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = add_port(server, address, credentials)
    await server.start()
    log.info("gRPC front door serving", address=address, port=bound)
    return server
