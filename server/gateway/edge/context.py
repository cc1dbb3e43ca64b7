"""The outermost layer of every request: its id, and the last line of defence against bugs.

Every request gets an id: the client's `x-request-id` when it sends a sane one, else a new
one. The id is kept in `scope["state"]["request_id"]` (the proxy forwards it to the engine and
logs it) and returned on every response. An exception nothing else handled becomes a single
logged line and a 500 in the OpenAI envelope, never a traceback in the answer.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from server.gateway.errors import InternalError, send_error

log = logging.getLogger("gateway")

REQUEST_ID_HEADER = b"x-request-id"
_SANE_ID = re.compile(rb"[\x21-\x7e]{1,128}")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _SANE_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


def request_id(scope: dict[str, Any]) -> str:
    """The id `RequestContextMiddleware` gave this request (a new one outside it)."""
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        rid = state["request_id"] = request_id_from(scope.get("headers", []))
    return rid


class RequestContextMiddleware:
    """Pure ASGI: request ids in and out, and a 500 envelope for anything unexpected."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = rid
        id_header = (REQUEST_ID_HEADER, rid.encode())
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = dict(message, headers=[*message.get("headers", ()), id_header])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unexpected error in request %s (%s %s)", rid, scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send_with_id, InternalError(
                    f"The gateway failed unexpectedly; its log has the details under request id {rid}."))
