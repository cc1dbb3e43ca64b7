"""ASGI plumbing the stand-in's endpoints share: reading bodies, JSON answers, the OpenAI error
envelope with vLLM's validation messages, and the watch for a client that leaves.

`ClientGone` (the client left before its body arrived) and `Died` (a `die_after_chunks` fault
fired) are control flow, never answered; `ApiError` becomes the OpenAI error envelope.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Died(Exception):
    """A `die_after_chunks` fault fired: the connection is to be dropped mid-response."""


class ApiError(Exception):
    """An answer in the OpenAI error envelope: status, message, type and param, as vLLM sends them."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


async def watch_disconnect(receive: Receive, main: asyncio.Task | None, state: dict) -> None:
    """Wait for http.disconnect; if the response is not finished yet, cancel the request's task."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not state["done"]:
                state["gone"] = True
                if main is not None:
                    main.cancel()
            return


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise validation_error("json_invalid", "body", f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise validation_error("model_attributes_type", "body", "Input should be a valid dictionary")
    return body


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise validation_error("list_type", "body.messages", "Input should be a valid list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise validation_error("missing", f"body.messages.{index}.role", "Field required")


def validation_error(kind: str, loc: str, msg: str) -> ApiError:
    detail = {"type": kind, "loc": loc, "msg": msg}
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def headers_of(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def request_id_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    request_id = header(scope, b"x-request-id")
    return [(b"x-request-id", request_id.encode())] if request_id else []


async def send_json(send: Send, status: int, payload: Any, headers: list | None = None) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + length + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ApiError, headers: list | None = None) -> None:
    envelope = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.status}}
    await send_json(send, error.status, envelope, headers)
