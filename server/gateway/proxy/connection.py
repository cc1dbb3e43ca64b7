"""One keep-alive HTTP/1.1 connection to an engine, as an asyncio protocol parsed by httptools.

The connection holds the state of the answer being read: status and headers, then the body,
either buffered for `read_chunk` (reading pauses above _PAUSE_ABOVE bytes not taken) or spliced:
each chunk handed to the caller's sink from httptools' own callback as it is parsed, with no
future or task step per chunk, and the sink flushed once after each socket read (chunks that
arrived together leave together; not after the read that ended the body: the caller sends that
with the end of its own answer); reading pauses while the sink's consumer is full. No timer per
read unless a read timeout is asked for. A body with neither a length nor chunks ends when the
engine closes the connection. The pool of these is `transport.UpstreamTransport`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import httptools
import httpx

_PAUSE_ABOVE = 1 << 20  # bytes of unread body that make a connection stop reading the socket


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; holds the state of the response being read."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.request: httpx.Request | None = None
        self._begin()

    def _begin(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.body_done = False
        self.keep_alive = False
        self.failure: str | None = None
        self.received = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.sink: Callable[[bytes], None] | None = None  # set while spliced (see splice)
        self.flush: Callable[[], bool] | None = None
        self.sunk = False  # this read gave the sink something to flush
        self.sink_error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.failure = f"malformed response from the engine: {exc}"
            self.close()
            self._wake()
        if self.sunk:  # (the flush inlined: this runs once per read of a streamed answer)
            self.sunk = False
            flush = self.flush
            if flush is not None and not self.body_done:  # else splice() returns, and the caller ends its answer
                try:
                    full = flush()
                except Exception as exc:  # noqa: BLE001 - the caller's failure: splice() raises it
                    self._sink_failed(exc)
                    return
                if full:
                    self._pause()

    def _sink_failed(self, exc: Exception) -> None:
        self.sink = self.flush = None
        self.sink_error = exc
        self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.body_done and self.failure is None:
            if exc is None and self.head_done and self._ends_at_close():
                self.body_done = True  # a body without a length ends where the connection does
            else:
                self.failure = str(exc) if exc else "the engine closed the connection"
        self._wake()

    def _ends_at_close(self) -> bool:
        """The response has neither a length nor chunks: its body is all the engine sends before it
        closes (HTTP/1.0 servers, and HTTP/1.1 ones that close; RFC 9112 section 6.3, the last rule)."""
        return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            try:
                sink(body)
            except Exception as exc:  # noqa: BLE001 - the caller's failure: splice() raises it, not the parser
                self._sink_failed(exc)
                return
            self.sunk = True
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_ABOVE:
            self._pause()
        self._wake()

    def on_message_complete(self) -> None:
        self.body_done = True
        self._wake()

    # -- used by the transport -------------------------------------------------------------------

    def _pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.transport.pause_reading()
            self.paused = True
            self._wake()

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        self._waiter = self.loop.create_future()
        try:
            if timeout is None:
                await self._waiter
            else:
                try:
                    async with asyncio.timeout(timeout):
                        await self._waiter
                except TimeoutError:
                    raise httpx.ReadTimeout("the engine sent nothing in time", request=self.request) from None
        finally:
            self._waiter = None

    def send(self, request: httpx.Request | None, head: bytes, body: bytes) -> None:
        self._begin()
        self.request = request
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def read_head(self, timeout: float | None) -> None:
        while not self.head_done:
            if self.failure is not None:
                raise httpx.RemoteProtocolError(
                    f"Server disconnected without sending a response ({self.failure}).", request=self.request
                )
            await self._wait(timeout)

    def _body_failed(self) -> httpx.RemoteProtocolError:
        return httpx.RemoteProtocolError(
            f"peer closed connection without sending complete message body ({self.failure})", request=self.request
        )

    def _take(self) -> bytes:
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        self._resume()
        return data

    async def read_chunk(self, timeout: float | None) -> bytes:
        """The body bytes received since the last call (b"" at the end of the body)."""
        while not self.chunks:
            if self.body_done:
                return b""
            if self.failure is not None:
                raise self._body_failed()
            await self._wait(timeout)
        return self._take()

    async def splice(
        self, sink: Callable[[bytes], None], flush: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Hand the rest of the body to `sink` chunk by chunk, from `on_body`, until it ends; `flush()`
        after each read that gave it chunks, except the one that ended the body (what that read gave
        is left to the caller, to send with its answer's end). `flush` returns True when the consumer is full: reading
        pauses until `drain()` returns. Raises what `read_chunk` raises, and what `sink` or `flush`
        raised. No read timeout: the caller keeps its own."""
        try:
            if self.chunks:
                sink(self._take())
                if flush():
                    self._pause()
            self.sink, self.flush = sink, flush
            while True:
                if self.sink_error is not None:
                    raise self.sink_error
                if self.paused:
                    await drain()
                    self._resume()
                elif self.body_done:
                    return
                elif self.failure is not None:
                    raise self._body_failed()
                else:
                    await self._wait(None)
        finally:
            self.sink = self.flush = None

    def reusable(self) -> bool:
        return self.body_done and self.keep_alive and not self.closed and self.failure is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
