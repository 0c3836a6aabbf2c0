"""What every gRPC front-door call passes before its method runs: the API key, and a
request message that parses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from scheduler_svc.api.keys import ApiKeys

Refusal = tuple[grpc.StatusCode, str]


@dataclass(frozen=True, slots=True)
class _Unparsed:
    """A request message protobuf refused (bad UTF-8 in a string field, a cut message)."""

    reason: str


class Gate(grpc.aio.ServerInterceptor):
    """Ends a call with UNAUTHENTICATED when keys are set and the call's metadata lacks
    ``authorization: Bearer KEY`` with one of them, and with INVALID_ARGUMENT when its
    message does not parse (grpc itself answers that with UNKNOWN, a server fault). Guards
    every method that takes one request message, as all of FrontDoor's do, present and
    future."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        refusal = None
        if self.keys.owner(call_authorization(details.invocation_metadata)) is None:
            message = "invalid or missing API key (metadata authorization: Bearer ...)"
            refusal = (grpc.StatusCode.UNAUTHENTICATED, message)
        return _guarded(handler, refusal)


def call_authorization(metadata: Any) -> str:
    """The ``authorization`` value of a call's metadata ("" without one)."""
    return str(dict(metadata or ()).get("authorization", ""))


def _guarded(handler: Any, refusal: Refusal | None) -> grpc.RpcMethodHandler:
    """``handler`` (unary request) with a parser that never raises and a method that first
    ends the call with ``refusal``, or INVALID_ARGUMENT for a message that did not parse."""
    parse = handler.request_deserializer

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return _Unparsed(str(e))

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        if refusal is not None:
            await context.abort(*refusal)
        if isinstance(request, _Unparsed):
            message = f"the request message does not parse: {request.reason}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    if handler.response_streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(request, context)
            async for response in handler.unary_stream(request, context):
                yield response

        return handler._replace(request_deserializer=lenient, unary_stream=stream)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(request, context)
        return await handler.unary_unary(request, context)

    return handler._replace(request_deserializer=lenient, unary_unary=unary)
