"""Everything the gateway itself refuses, and the one place that turns it into an OpenAI error.

    GatewayError                 status  type                   code
    ├── InvalidRequest            400    invalid_request_error  (per case: invalid_json, ...)
    ├── AuthenticationFailed      401    invalid_request_error  invalid_api_key
    ├── PermissionDenied          403    invalid_request_error  permission_denied
    ├── RouteNotFound             404    invalid_request_error  not_found
    ├── ModelNotFound             404    invalid_request_error  model_not_found
    ├── ResponseNotFound          404    invalid_request_error  response_not_found
    ├── MethodNotAllowed          405    invalid_request_error  method_not_allowed
    ├── BodyTooLarge              413    invalid_request_error  request_too_large
    ├── InternalError             500    server_error           internal_error
    ├── UpstreamFailed            502    upstream_error         upstream_failed
    ├── NoEngineAvailable         503    service_unavailable    no_healthy_engine
    └── UpstreamTimeout           504    timeout                upstream_timeout

Errors that come from an engine are not in this hierarchy: they pass through with the
engine's own status and body, and a body that is not the OpenAI envelope (FastAPI's
`{"detail": "Not Found"}` for an endpoint the engine does not serve, vLLM's `{"error":
"Unauthorized"}`) is put in one by `engine_error_body`. `error_body` renders an error for a plain response and
`stream_error_event` for a stream that has already begun (the HTTP status is then 200, so
the error travels as an SSE event followed by `[DONE]`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]


ECHO_LIMIT = 100  # characters of a client's value repeated in an answer or a log line


def echo(value: str, limit: int = ECHO_LIMIT) -> str:
    """A client-supplied value, cut to `limit` characters, to quote back in a message."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


class GatewayError(Exception):
    """A request the gateway answers itself, with an OpenAI error envelope."""

    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = list(headers)
        self.model: str | None = None  # the model the refused request named, when it got that far (metrics label)

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class RouteNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str, known: Iterable[str]) -> None:
        names = ", ".join(sorted(known)) or "none"
        super().__init__(f"The model `{echo(model)}` does not exist. Known models: {names}.", param="model")


class ResponseNotFound(GatewayError):
    """A stored response (Responses API) that no engine behind the gateway can answer for."""

    status = 404
    type = "invalid_request_error"
    code = "response_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than the gateway's limit of {limit} bytes.")


class InternalError(GatewayError):
    """Something broke in the gateway itself; the details are in its log, not in the answer."""


class UpstreamFailed(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_failed"


class NoEngineAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_engine"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"


class ClientDisconnected(Exception):
    """The client went away; there is nobody left to answer."""


def error_body(exc: GatewayError) -> bytes:
    return json.dumps(exc.envelope()).encode()


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
}


def engine_error_body(status: int, content: bytes) -> bytes | None:
    """An engine's error answer in the OpenAI envelope, or None when it already is one.

    The message is the engine's own (`detail`, or `error` when it is a string, or the body text)."""
    try:
        payload = json.loads(content) if content.strip() else None
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return None
    message: object = content.decode("utf-8", "replace").strip()
    if isinstance(payload, dict):
        message = payload.get("detail", payload.get("error", message))
    if not isinstance(message, str):
        message = json.dumps(message)
    envelope = {
        "error": {
            "message": message or f"The engine answered {status}.",
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": None,
            "code": _CODES.get(status, "upstream_error" if status >= 500 else None),
        }
    }
    return json.dumps(envelope).encode()


def stream_error_event(exc: GatewayError) -> bytes:
    """The end of a stream that failed after it began: an error event, then `[DONE]`."""
    return b"data: " + error_body(exc) + b"\n\ndata: [DONE]\n\n"


async def send_error(send: Send, exc: GatewayError, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer with `exc` as a complete JSON response (the response must not have started)."""
    body = error_body(exc)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *exc.headers,
        *headers,
    ]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
