"""The gateway's HTTP/1.1 connection: uvicorn's httptools protocol with limits for hostile clients.

uvicorn serves each connection with one protocol object. Ours adds what a public-facing
server needs and uvicorn does not do by itself:
- a connection must send a request's headers within `header_timeout` of opening or of its
  first byte (a silent or slowloris connection is answered 408 and closed);
- a request body must arrive within `body_timeout` of the headers (then the connection closes:
  the request sees a disconnect, as if the client had left);
- at most `max_connections` client connections at once; one more is answered 503 and closed;
- malformed HTTP (bad Content-Length, Content-Length with Transfer-Encoding, a bad chunk size,
  an unknown method) is answered 400 in the OpenAI error envelope, not in plain text;
- the app can abort a request's connection (`abort_connection(send)`): a stream whose client
  stopped reading is closed without waiting for the unsent bytes to drain;
- the app can write a started streamed body straight to the connection (`body_writer(send)`):
  the relay frames each chunk and writes it from the engine connection's callback, without an
  ASGI message, uvicorn's `send` and a task step per chunk.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.gateway.errors import GatewayError, InvalidRequest, error_body


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class TooManyConnections(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def raw_error_response(exc: GatewayError) -> bytes:
    """A complete HTTP/1.1 error response, for answers written before any ASGI app runs."""
    body = error_body(exc)
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (exc.status, _REASONS[exc.status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
    )


class ConnectionLimits:
    """The limits every connection of one server shares."""

    def __init__(self, *, header_timeout: float, body_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections

    def protocol(self) -> type[HttpToolsProtocol]:
        """A protocol class for `uvicorn.Config(http=...)` bound to these limits."""
        limits = self

        class Bound(GatewayHttpProtocol):
            pass

        Bound.limits = limits
        return Bound


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's protocol plus the limits of the module doc."""

    limits: ConnectionLimits  # set on the class by ConnectionLimits.protocol()
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                TooManyConnections(
                    f"The gateway has {self.limits.max_connections} open connections, its limit; retry shortly."
                )
            )
            return
        self._arm(self.limits.header_timeout, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self._refuse(InvalidRequest(f"Malformed HTTP request: {msg.rstrip('.')}.", code="invalid_http"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # a keep-alive connection's next request: its headers are due too
            self._arm(self.limits.header_timeout, "headers")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._arm(self.limits.body_timeout, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # -- timers -----------------------------------------------------------------------------------

    def _arm(self, seconds: float, stage: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, stage)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, stage: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if stage == "headers" and (self.cycle is None or self.cycle.response_complete):
            self._refuse(
                RequestTimeout(f"The request's headers did not arrive within {self.limits.header_timeout:g} s.")
            )
        else:  # the app is reading the body: closing makes it see a disconnect
            self.transport.close()

    def _refuse(self, exc: GatewayError) -> None:
        self.transport.write(raw_error_response(exc))
        self.transport.close()


def abort_connection(send: Any) -> bool:
    """Close the connection of the request that `send` (uvicorn's) answers, at once, dropping what it
    has not sent; False if `send` is not uvicorn's. The request's pending `send` returns, and uvicorn
    logs nothing: to it the client has gone. Nothing is stored per request (a reference from the
    request's scope to its connection would be a cycle for the garbage collector, per request)."""
    cycle: Any = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not hasattr(cycle, "disconnected"):
        return False
    if not getattr(cycle, "response_complete", True):
        cycle.disconnected = True
    transport.abort()
    return True


class ChunkedWriter:
    """A started chunked response's body, written straight to the client's transport (`body_writer`).

    `write` frames one HTTP/1.1 chunk; `flush` writes what was framed since the last flush in one
    system call (the relay flushes once per read from the engine: chunks that arrived together
    leave together) and returns True when the client's buffer is above its high-water mark
    (uvicorn's flow control): the caller then waits for `drain()` before writing more. A client
    that has gone is written nothing. The response is still ended through uvicorn's `send` (it
    writes the last chunk and keeps the connection's state for keep-alive), after a flush.
    """

    __slots__ = ("_cycle", "_flow", "_pending", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._pending.append(b"%x\r\n%b\r\n" % (len(data), data))

    def flush(self) -> bool:
        pending = self._pending
        if not pending:
            return False
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        if self._cycle.disconnected:
            return False
        self._transport.write(data)
        return self._flow.write_paused  # type: ignore[no-any-return]

    async def drain(self) -> None:
        self.flush()
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()

    def release(self) -> bytes:
        """Before the response goes on through `send`: what was written goes out now (b"" is left)."""
        self.flush()
        return b""


class SendWriter:
    """The same interface over any ASGI `send` (under a server other than the gateway's own): a flush
    with something written asks for a drain, which sends it as one body message."""

    __slots__ = ("_pending", "_send")

    def __init__(self, send: Any) -> None:
        self._send = send
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._pending.append(data)

    def flush(self) -> bool:
        return bool(self._pending)

    async def drain(self) -> None:
        if self._pending:
            await self._send({"type": "http.response.body", "body": self.release(), "more_body": True})

    def release(self) -> bytes:
        """Before the response goes on through `send`: what was written and not sent, to send first."""
        body = b"".join(self._pending)
        self._pending.clear()
        return body


def body_writer(send: Any) -> ChunkedWriter | SendWriter:
    """How to write the body of the response `send` has started: straight to uvicorn's transport
    when `send` is uvicorn's and the response is chunked, else through `send`."""
    cycle: Any = getattr(send, "__self__", None)
    if (
        getattr(cycle, "chunked_encoding", None) is True
        and getattr(cycle, "response_started", False)
        and not getattr(cycle, "response_complete", True)
        and hasattr(cycle, "flow")
        and hasattr(cycle, "transport")
    ):
        return ChunkedWriter(cycle)
    return SendWriter(send)


def protocol_for(settings: Any) -> type[HttpToolsProtocol]:
    """The protocol class for a gateway's `limits` settings."""
    limits = settings.limits
    return ConnectionLimits(
        header_timeout=limits.header_timeout,
        body_timeout=limits.body_timeout,
        max_connections=limits.max_client_connections,
    ).protocol()
