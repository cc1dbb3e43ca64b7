"""The seam's writing half (http.seam): a started response's body written straight to uvicorn's
transport, or through any ASGI `send` under another server.

Like the rest of the seam it reads uvicorn's per-request cycle (`transport`, `flow`,
`disconnected`, `response_started`, `response_complete`, `chunked_encoding`; for the heads below
also `scope`, `default_headers`, `keep_alive`, `access_log`, `access_logger`,
`waiting_for_100_continue`, `expected_content_length`, and the module's `STATUS_LINE`); the
internals are checked at start by `compat.uvicorn_problems()` and tested in
tests/gateway/http/test_uvicorn_internals.py and test_head_writer.py. Imported through http.seam.

The gateway's answer heads (`start_body`, `send_whole`) are written here too, as uvicorn's `send`
writes them: its status lines, its default headers, its checks of names and values, the same
connection state afterwards. The checks run once over the whole head (`bytes.translate`) instead
of two regular expressions a header: a tenant's answer carries six rate-limit headers, and those
checks were a tenth of what a tenant's request costs the gateway. A head this writer does not
handle the way uvicorn would (a `connection` header, a HEAD request, 204/304, a bad name or value)
goes through uvicorn's `send`, which writes it or raises as before.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

_CYCLE: Any  # uvicorn's per-request cycle class (None: not found): the heads written here are its answers'
try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
    from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

    _CYCLE = RequestResponseCycle
except ImportError:  # another uvicorn: every head goes through its `send` (compat.uvicorn_problems names what lacks)
    _CYCLE = None


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


# The bytes uvicorn's HEADER_RE and HEADER_VALUE_RE refuse in a name and in a value (checked against
# them byte by byte in the tests): `translate` drops them in one C pass over the head, where a
# regular expression's character class costs ~40 instructions a byte.
BAD_NAME_BYTES = bytes(range(0x20)) + b'\x7f()<>@,;:[]={} \t\\"'
BAD_VALUE_BYTES = bytes([*range(0x09), *range(0x0A, 0x20), 0x7F])


def _head(cycle: Any, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The head uvicorn's `send` would write for `http.response.start` with `status` and `headers`,
    with the cycle left as `send` leaves it; None (nothing changed) for a head `send` must write.
    Every step over the headers is one C call (`zip`, `join`, `lower`, `translate`, `split`): a
    Python statement a header was most of what a head cost."""
    scope = cycle.scope
    if status in (204, 304) or scope["method"] == "HEAD":
        return None
    pairs = [*cycle.default_headers, *headers]
    if not pairs:  # (no date or server header either: nothing to join the lines of)
        return None
    names_in, values = zip(*pairs)
    # The names lowered as one text: a name holding a newline (or any byte a name may not hold)
    # makes the text lose more bytes to `translate` than the newlines put between the names.
    names_text = b"\n".join(names_in).lower()
    if len(names_text.translate(None, BAD_NAME_BYTES)) != len(names_text) - len(names_in) + 1:
        return None  # uvicorn's send refuses it
    values_text = b"\t".join(values)
    if len(values_text.translate(None, BAD_VALUE_BYTES)) != len(values_text):
        return None  # uvicorn's send refuses it
    names = names_text.split(b"\n")
    length: int | None = None
    acted_on = _ACTED_ON.intersection(names)
    if acted_on:
        # a connection header may close the connection, transfer-encoding or a second length make
        # uvicorn's choices subtler: its send decides those (the gateway's answers have neither)
        if acted_on != _LENGTH or names.count(b"content-length") > 1:
            return None
        length = int(values[names.index(b"content-length")].decode())
    if cycle.access_log:  # uvicorn's access log, where it is on (the gateway's `serve` has its own)
        cycle.access_logger.info(
            '%s - "%s %s HTTP/%s" %d',
            get_client_addr(scope),
            scope["method"],
            get_path_with_query_string(scope),
            scope["http_version"],
            status,
        )
    tail = b"\r\n" if cycle.keep_alive else b"\r\nconnection: close\r\n"
    if length is None:  # no length given: uvicorn's send makes the body chunked
        tail += b"transfer-encoding: chunked\r\n"
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = length is None
    cycle.expected_content_length = length or 0
    return STATUS_LINE[status] + b"\r\n".join(map(b": ".join, zip(names, values))) + tail + b"\r\n"


_ACTED_ON = frozenset({b"content-length", b"transfer-encoding", b"connection"})  # what uvicorn's send acts on
_LENGTH = frozenset({b"content-length"})


def _own_head(cycle: Any, message: MutableMapping[str, Any]) -> bytes | None:
    """`message`'s head written here (`_head`) when `cycle` is uvicorn's, its response not started
    and its client taking writes now; else None, and `send` is to take the message."""
    if _CYCLE is None or type(cycle) is not _CYCLE or cycle.response_started or cycle.flow.write_paused:
        return None
    if cycle.disconnected:
        return None
    return _head(cycle, message["status"], message["headers"])


async def send_whole(send: Any, message: MutableMapping[str, Any], body: bytes) -> None:
    """Send `message` (`http.response.start`, with its content-length) and `body`, the whole
    answer: under uvicorn the head is written here (see the module doc), the body through `send`."""
    cycle: Any = getattr(send, "__self__", None)
    head = _own_head(cycle, message)
    if head is None:
        await send(message)
    else:
        cycle.transport.write(head)
    await send({"type": "http.response.body", "body": body, "more_body": False})


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

    Under uvicorn the head (written here, see the module doc, or else by uvicorn's `send`) is held
    by the writer and leaves with the first flush: the head and the first chunk in one system call
    instead of two. (uvicorn's `send` writes a head to `cycle.transport` and does nothing else with
    it, and does not wait when the client's buffer is not full: for that one call the transport is
    a stand-in.)"""
    cycle: Any = getattr(send, "__self__", None)
    head = _own_head(cycle, message)
    if head is not None:
        if cycle.chunked_encoding:
            return ChunkedWriter(cycle, head)
        cycle.transport.write(head)
        return SendWriter(send)
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
