"""The ASGI vocabulary of the gateway: types, header lookup, body reading, plain answers.

Every module that speaks ASGI imports its types from here, so a scope, a `receive` and a
`send` mean the same thing everywhere. Nothing here knows about models or engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.gateway.errors import BodyTooLarge, ClientDisconnected

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


def header(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case, as ASGI servers deliver names), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def header_str(headers: Headers, name: bytes) -> str | None:
    """`header` decoded as latin-1 (what HTTP/1.1 allows in a header value)."""
    value = header(headers, name)
    return None if value is None else value.decode("latin-1")


async def read_body(receive: Receive, headers: Headers, limit: int) -> bytes:
    """The whole request body; 413 past `limit` (announced or counted); ClientDisconnected if the client left."""
    length = header(headers, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes, headers: Headers | None = None) -> None:
    """A complete response with a known length."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
