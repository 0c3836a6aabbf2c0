"""How failures leave the front doors: every exception as the OpenAI-style error a client
sees, with a 4xx status for the client's mistakes and a 5xx one for ours."""

from __future__ import annotations

from typing import Any

import structlog
from starlette.requests import ClientDisconnect

from scheduler_svc.state.redis_store import OUTAGE_ERRORS
from scheduler_svc.state.store_stream import (
    EventOutOfRangeError,
    RequestIdConflictError,
    RequestVanishedError,
)
from scheduler_svc.state.streams import (
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestInFlightError,
)

log = structlog.get_logger(__name__)


class APIError(Exception):
    """An error the client sees as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# Exceptions the engine and the store raise for one request, as (status, code).
_KNOWN: tuple[tuple[type[Exception], int, str], ...] = (
    (RequestInFlightError, 409, "conflict"),
    (RequestIdConflictError, 409, "request_id_conflict"),
    (RequestVanishedError, 400, "request_not_found"),
    (EventOutOfRangeError, 400, "event_out_of_range"),
    (EngineDeadError, 503, "engine_unavailable"),
    (QueueFullError, 429, "queue_full"),
    *((kind, 503, "store_unavailable") for kind in OUTAGE_ERRORS),
    (ClientDisconnect, 400, "client_disconnected"),  # gone before its body was read
)


def require(ok: bool, message: str, param: str) -> None:
    """APIError(400) naming ``param`` unless ``ok``."""
    if not ok:
        raise APIError(400, message, param=param)


_TYPES = {429: "rate_limit_error"}
# A request the engine ended without a result: its timeout passed (504), the executor could
# not use its grammar (400: the scheduler could not check it, see api/structured.py), else
# our failure.
_FAILED_STATUS = {"deadline_exceeded": 504, "invalid_grammar": 400}


def client_error(e: Exception, request_id: str | None) -> APIError:
    """The error that answers ``e``. One our code did not expect is logged with the
    request id and answered as a 500 that says nothing of the server's insides."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestFailedError):
        status = _FAILED_STATUS.get(e.code, 500)
        type_ = "server_error" if status >= 500 else "invalid_request_error"
        return APIError(status, str(e), code=e.code, type=type_)
    for kind, status, code in _KNOWN:
        if isinstance(e, kind):
            type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
            return APIError(status, str(e), code=code, type=type_)
    log.error("request failed", request_id=request_id, error=repr(e), exc_info=e)
    return APIError(
        500,
        "the server failed to answer this request; its log says why",
        code="internal_error",
        type="server_error",
    )
