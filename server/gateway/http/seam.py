"""The one module that reaches below ASGI into uvicorn: the gateway's HTTP/1.1 connection.

Everything the gateway relies on beyond the ASGI spec is here (its writing half in http.writers,
its check of the installed uvicorn in http.compat, both imported through this module), and
nowhere else: uvicorn's
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
- a request's head: at most `max_head_bytes` in all (counted in `data_received` before httptools,
  which holds a header value whole, sees them: a 64 MB header is never held), `max_headers`
  headers and `max_header_value_bytes` a value (checked once the head is complete, which the head
  cap keeps to a bounded size; the values are looked at only when the head is longer than one
  value may be); past a cap, 431 and closed;
- connection slots (http.admission): at the `max_connections` cap an idle connection is let go
  for a newcomer (503 only when all are busy); per-address caps (429); the app marks a connection
  whose request passed the API key check (`mark_authenticated(send)`);
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
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.gateway.errors import GatewayError, InvalidRequest, echo, send_error
from server.gateway.http.admission import (
    Admission,
    HeaderFieldsTooLarge,
    RequestTimeout,
    Slot,
    TooManyConnections,
    raw_error_response,
)
from server.gateway.http.compat import uvicorn_problems
from server.gateway.http.writers import ChunkedWriter, SendWriter, body_writer, send_whole, start_body

# http.writers' and http.compat's, re-exported
__all__ = ["ChunkedWriter", "SendWriter", "body_writer", "send_whole", "start_body", "uvicorn_problems"]


class ConnectionLimits:
    """The limits every connection of one server shares, and its connection slots (`admission`)."""

    def __init__(
        self,
        *,
        header_timeout: float,
        body_timeout: float,
        max_connections: int,
        max_connections_per_peer: int = 0,
        max_unauthenticated_per_peer: int = 0,
        max_headers: int = 100,
        max_header_value_bytes: int = 16 * 2**10,
        max_head_bytes: int = 64 * 2**10,
    ) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.max_headers = max_headers
        self.max_header_value_bytes = max_header_value_bytes
        self.max_head_bytes = max_head_bytes
        self.admission = Admission(
            max_connections=max_connections,
            max_per_peer=max_connections_per_peer,
            max_unauthenticated_per_peer=max_unauthenticated_per_peer,
        )

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
    _slot: Slot | None = None  # the connection's slot (http.admission), once admitted
    _head_bytes = 0  # bytes received while a request's head is due, since the last complete head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client
        admitted = self.limits.admission.admit(client[0] if client else "", self._let_go)
        if isinstance(admitted, GatewayError):
            self._refuse(admitted)
            return
        self._slot = admitted
        self._expect("headers", self.limits.header_timeout)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._stage != "body":  # a head is due (this request's or the next one's): count it first
            room = self.limits.max_head_bytes - self._head_bytes
            if len(data) > room:
                self._head_past_its_room(data, room)
                return
            self._head_bytes += len(data)
        super().data_received(data)
        if self._stage is not None and self._timer is None:
            self._arm()

    def _head_past_its_room(self, data: bytes, room: int) -> None:
        """A read longer than what is left of the head cap: httptools gets the part within the cap;
        if the head ended there the rest goes on (a body, the next request), else 431."""
        view = memoryview(data)  # httptools takes any buffer: the parts are not copied
        if room > 0:
            self._head_bytes += room
            super().data_received(view[:room])  # type: ignore[arg-type]
            if self.transport.is_closing():
                return
        if self._head_bytes == 0:  # reset by on_headers_complete: the head ended within the cap
            self.data_received(view[room:])  # type: ignore[arg-type]
            return
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # an answer is being written: no room for ours
            self.transport.close()
            return
        self._refuse(
            HeaderFieldsTooLarge(
                f"The request's head (request line and headers) is longer than the gateway's limit of "
                f"{self.limits.max_head_bytes} bytes (limits.max_head_bytes)."
            )
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        slot = self._slot
        if slot is not None:
            self._slot = None
            self.limits.admission.release(slot)
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

    def _let_go(self) -> None:
        """This idle connection's slot goes to a newcomer (http.admission): closed, with a 503 if it
        has never been answered or is sending a request's head, as a keep-alive expiry else."""
        self._disarm()
        if self.transport.is_closing():  # already on its way out (its slot is freed when it is gone)
            return
        if self.cycle is None or self._head_bytes:
            self._refuse(
                TooManyConnections(
                    f"The gateway is at its limit of {self.limits.max_connections} connections and "
                    "closed this idle one for a newer client; retry."
                )
            )
        else:
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._stage is None:  # a keep-alive connection's next request: its headers are due too
            self._expect("headers", self.limits.header_timeout)

    def on_headers_complete(self) -> None:
        limits = self.limits
        head_bytes = self._head_bytes
        self._stage = None
        self._head_bytes = 0
        if self._slot is not None:
            limits.admission.busy(self._slot)
        # The caps on the head's lines, once per head instead of once per header (uvicorn's own
        # on_header stays the only Python call per header): a value can be over its cap only in
        # a head longer than the cap (`head_bytes` counts every byte read since the last head).
        if len(self.headers) > limits.max_headers or head_bytes > limits.max_header_value_bytes:
            refusal = self._head_refusal(limits)
            if refusal is not None:  # the request runs as usual (its body read, dropped), the refusal as its app
                app, self.app = self.app, _Refuse(refusal)
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                self._expect("body", limits.body_timeout)
                return
        super().on_headers_complete()
        self._expect("body", limits.body_timeout)

    def _head_refusal(self, limits: ConnectionLimits) -> GatewayError | None:
        """431 for a value longer than `max_header_value_bytes` or more than `max_headers` headers."""
        for name, value in self.headers:
            if len(value) > limits.max_header_value_bytes:
                return HeaderFieldsTooLarge(
                    f"The request header {echo(name.decode('latin-1'))!r} is longer than the gateway's limit of "
                    f"{limits.max_header_value_bytes} bytes a value (limits.max_header_value_bytes)."
                )
        if len(self.headers) > limits.max_headers:
            return HeaderFieldsTooLarge(
                f"The request has more than {limits.max_headers} headers, the gateway's limit "
                "(limits.max_request_headers)."
            )
        return None

    def on_message_complete(self) -> None:
        self._stage = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        slot = self._slot
        if slot is not None and self.cycle.response_complete and not self.transport.is_closing():
            self.limits.admission.idle(slot)  # between keep-alive requests

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


class _Refuse:
    """An ASGI app that answers any request with `exc` and closes the connection."""

    def __init__(self, exc: GatewayError) -> None:
        self.exc = exc

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send_error(send, self.exc, [(b"connection", b"close")])


def _protocol_of(send: Any) -> GatewayHttpProtocol | None:
    """The GatewayHttpProtocol connection of the request `send` (uvicorn's) answers, or None."""
    try:
        protocol = send.__self__.transport.get_protocol()
    except AttributeError:  # not uvicorn's `send`, or a cycle without its transport
        return None
    return protocol if isinstance(protocol, GatewayHttpProtocol) else None


def mark_authenticated(send: Any, *, keys_checked: bool = True) -> None:
    """The request `send` answers passed the API key check: its connection counts as authenticated
    (http.admission: it is let go last at the cap, and leaves its peer's unauthenticated count).
    `keys_checked=False`: the gateway has no keys, so every connection counts as authenticated.
    Nothing happens when `send` is not a GatewayHttpProtocol connection's."""
    protocol = _protocol_of(send)
    slot = protocol._slot if protocol is not None else None
    if slot is not None and protocol is not None:
        protocol.limits.admission.authenticate(slot, keys_checked)


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
    protocol = _protocol_of(send)
    if protocol is None or not hasattr(cycle, "disconnected"):
        return None
    if cycle.disconnected or cycle.response_complete:  # `receive` would answer http.disconnect at once
        protocol.loop.call_soon(callback)
        return _keep_watching_nothing
    cycle.flow.resume_reading()  # as `receive` does: a paused connection would not see its client leave
    protocol._disconnect_watch = (cycle, callback)
    return protocol._unwatch_disconnect


def _keep_watching_nothing() -> None:
    pass


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
        max_connections_per_peer=limits.max_connections_per_peer,
        max_unauthenticated_per_peer=limits.max_unauthenticated_per_peer,
        max_headers=limits.max_request_headers,
        max_header_value_bytes=limits.max_header_value_bytes,
        max_head_bytes=limits.max_head_bytes,
    ).protocol()
