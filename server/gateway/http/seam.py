"""The one module that reaches below ASGI into uvicorn: the gateway's HTTP/1.1 connection.

Everything the gateway relies on beyond the ASGI spec is here, and nowhere else: uvicorn's
httptools protocol class (subclassed), its per-request cycle (`send.__self__`: `transport`,
`flow`, `disconnected`, `response_started`, `response_complete`, `chunked_encoding`) and its flow
control (`write_paused`, `drain`, `resume_reading`). uvicorn is pinned to the releases tested
(pyproject.toml), tests/gateway/http/test_uvicorn_internals.py has a test per internal, and
`uvicorn_problems()` checks the installed uvicorn at start: with one that differs, the gateway
logs what differs and runs on uvicorn's own protocol and plain ASGI `send` (slower streams, and
without the limits below), instead of failing at the first request.

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
  ASGI message, uvicorn's `send` and a task step per chunk;
- the app can learn that a request's client left from the connection itself
  (`watch_disconnect(send, callback)`), without a task per request waiting on `receive`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, MutableMapping
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
    # What the connection waits for ("headers", "body" or None) and by when (the loop's clock). The
    # timer is armed after a read that left something due, not per request: a request that
    # arrives whole in one read (the common case) arms and cancels no timer at all.
    _stage: str | None = None
    _due = 0.0
    _timer: asyncio.TimerHandle | None = None
    # (the request's cycle, what to call if its client leaves): see watch_disconnect
    _disconnect_watch: tuple[Any, Callable[[], None]] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                TooManyConnections(
                    f"The gateway has {self.limits.max_connections} open connections, its limit; retry shortly."
                )
            )
            return
        self._expect("headers", self.limits.header_timeout)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._stage is not None and self._timer is None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        watch = self._disconnect_watch
        if watch is not None:
            self._disconnect_watch = None
            cycle, callback = watch
            if cycle.disconnected:  # what the request's `receive` would now answer http.disconnect for
                callback()

    def _unwatch_disconnect(self) -> None:
        self._disconnect_watch = None

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self._refuse(InvalidRequest(f"Malformed HTTP request: {msg.rstrip('.')}.", code="invalid_http"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._stage is None:  # a keep-alive connection's next request: its headers are due too
            self._expect("headers", self.limits.header_timeout)

    def on_headers_complete(self) -> None:
        self._stage = None
        super().on_headers_complete()
        self._expect("body", self.limits.body_timeout)

    def on_message_complete(self) -> None:
        self._stage = None
        super().on_message_complete()

    # -- timers -----------------------------------------------------------------------------------

    def _expect(self, stage: str, seconds: float) -> None:
        self._stage = stage
        self._due = self.loop.time() + seconds

    def _arm(self) -> None:
        self._timer = self.loop.call_at(self._due, self._expired)

    def _disarm(self) -> None:
        self._stage = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        stage = self._stage
        if stage is None or self.transport.is_closing():
            return
        if self._due - self.loop.time() > 0.001:  # armed for an earlier stage, since done: wait for this one
            self._arm()
        elif stage == "headers" and (self.cycle is None or self.cycle.response_complete):
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


def watch_disconnect(send: Any, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call `callback()` once if the client of the request that `send` (uvicorn's, on a
    GatewayHttpProtocol connection) answers leaves before its response is complete: when its
    `receive` would return `http.disconnect`, but from the connection's own `connection_lost`,
    with no task waiting on `receive`. Returns the function that stops watching (to be called
    before the request ends: the connection holds `callback` until then); None when `send` is
    not such a connection's (then wait on `receive` for `http.disconnect`)."""
    cycle: Any = getattr(send, "__self__", None)
    get_protocol = getattr(getattr(cycle, "transport", None), "get_protocol", None)
    protocol = get_protocol() if get_protocol is not None else None
    if not isinstance(protocol, GatewayHttpProtocol) or not hasattr(cycle, "disconnected"):
        return None
    if cycle.disconnected or cycle.response_complete:  # `receive` would answer http.disconnect at once
        protocol.loop.call_soon(callback)
        return _keep_watching_nothing
    cycle.flow.resume_reading()  # as `receive` does: a paused connection would not see its client leave
    protocol._disconnect_watch = (cycle, callback)
    return protocol._unwatch_disconnect


def _keep_watching_nothing() -> None:
    pass


class ChunkedWriter:
    """A started chunked response's body, written straight to the client's transport (`body_writer`).

    `write` takes bytes for the client; `flush` writes what was written since the last flush as one
    HTTP/1.1 chunk in one system call (the relay flushes once per read from the engine: chunks
    that arrived together leave together), after the response head if that is still held
    (`start_body`: the head and the first chunk leave together), and returns True when the
    client's buffer is above its high-water mark (uvicorn's flow control): the caller then waits
    for `drain()` before writing more. A client that has gone is written nothing. The response
    is ended through uvicorn's `send` (it keeps the connection's state for keep-alive), with what
    `release` returns as its last body: the last chunks and the end of the response in one write.
    """

    __slots__ = ("_cycle", "_flow", "_head", "_pending", "_transport", "write")

    def __init__(self, cycle: Any, head: bytes = b"") -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport
        self._head = head  # the response head, until the first flush
        self._pending: list[bytes] = []
        # `write(data)`: bytes for the client, kept until the next flush (the list's own `append`:
        # the relay calls it once per chunk, and a method around it would cost a Python call).
        self.write: Callable[[bytes], None] = self._pending.append

    def flush(self) -> bool:
        pending = self._pending
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            if data:  # (an empty chunk would end the response)
                data = b"%x\r\n%b\r\n" % (len(data), data)
        elif not self._head:
            return False
        else:
            data = b""
        if self._head:
            data = self._head + data
            self._head = b""
        if not data or self._cycle.disconnected:
            return False
        self._transport.write(data)
        return self._flow.write_paused  # type: ignore[no-any-return]

    async def drain(self) -> None:
        self.flush()
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()

    def release(self) -> bytes:
        """Before the response goes on through `send`: what was written and not flushed, to send first
        (a head still held goes out now)."""
        if self._head:
            head, self._head = self._head, b""
            if not self._cycle.disconnected:
                self._transport.write(head)
        body = b"".join(self._pending)
        self._pending.clear()
        return body


class _HeldWrites:
    """Stands in for a connection's transport while uvicorn's `send` writes a response head."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class SendWriter:
    """The same interface over any ASGI `send` (under a server other than the gateway's own): a flush
    with something written asks for a drain, which sends it as one body message."""

    __slots__ = ("_pending", "_send", "write")

    def __init__(self, send: Any) -> None:
        self._send = send
        self._pending: list[bytes] = []
        self.write: Callable[[bytes], None] = self._pending.append  # as ChunkedWriter's

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


async def start_body(send: Any, message: MutableMapping[str, Any]) -> ChunkedWriter | SendWriter:
    """Send `message` (`http.response.start`) and return the writer of the body it starts (`body_writer`).

    Under uvicorn the head its `send` writes is held by the writer and leaves with the first
    flush: the head and the first chunk in one system call instead of two. (uvicorn's `send`
    writes a head to `cycle.transport` and does nothing else with it, and does not wait when
    the client's buffer is not full: for that one call the transport is a stand-in.)"""
    cycle: Any = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    flow = getattr(cycle, "flow", None)
    if transport is None or flow is None or flow.write_paused or getattr(cycle, "response_started", True):
        await send(message)
        return body_writer(send)
    held = _HeldWrites()
    cycle.transport = held
    try:
        await send(message)
    finally:
        cycle.transport = transport
    writer = body_writer(send)
    if isinstance(writer, ChunkedWriter):
        writer._head = held.data
    elif held.data:
        transport.write(held.data)
    return writer


# What the seam calls or overrides on uvicorn's classes; instance attributes are checked by the tests.
PROTOCOL_METHODS = (
    "connection_made",
    "data_received",
    "connection_lost",
    "send_400_response",
    "on_message_begin",
    "on_headers_complete",
    "on_message_complete",
)
CYCLE_METHODS = ("send", "receive")
FLOW_METHODS = ("drain", "resume_reading", "pause_reading")


def uvicorn_problems() -> list[str]:
    """What differs in the installed uvicorn from what the seam relies on ([] when nothing does)."""
    from uvicorn.protocols.http import flow_control, httptools_impl

    problems = [
        f"HttpToolsProtocol.{name}" for name in PROTOCOL_METHODS if not callable(getattr(HttpToolsProtocol, name, None))
    ]
    cycle = getattr(httptools_impl, "RequestResponseCycle", None)
    problems += [f"RequestResponseCycle.{name}" for name in CYCLE_METHODS if not callable(getattr(cycle, name, None))]
    flow = getattr(flow_control, "FlowControl", None)
    problems += [f"FlowControl.{name}" for name in FLOW_METHODS if not callable(getattr(flow, name, None))]
    return problems


def protocol_for(settings: Any) -> type[HttpToolsProtocol] | str:
    """The protocol class for a gateway's `limits` settings; uvicorn's own ("httptools") if the
    installed uvicorn is not the one the seam was written for (see the module doc)."""
    problems = uvicorn_problems()
    if problems:
        import uvicorn

        logging.getLogger("gateway").warning(
            "uvicorn %s lacks what the gateway's connection handling relies on (%s): serving on uvicorn's "
            "own protocol, without header/body timeouts and the connection cap, and streams through ASGI send",
            uvicorn.__version__,
            ", ".join(problems),
        )
        return "httptools"
    limits = settings.limits
    return ConnectionLimits(
        header_timeout=limits.header_timeout,
        body_timeout=limits.body_timeout,
        max_connections=limits.max_client_connections,
    ).protocol()
