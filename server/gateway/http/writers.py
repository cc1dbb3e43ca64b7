"""The seam's writing half (http.seam): a started response's body written straight to uvicorn's
transport, or through any ASGI `send` under another server.

Like the rest of the seam it reads uvicorn's per-request cycle (`transport`, `flow`,
`disconnected`, `response_started`, `response_complete`, `chunked_encoding`); the internals are
checked at start by `seam.uvicorn_problems()` and tested one by one in
tests/gateway/http/test_uvicorn_internals.py. Imported through http.seam.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any


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
