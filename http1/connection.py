"""One keep-alive HTTP/1.1 client connection, as an asyncio protocol parsed by httptools.

The connection sends one request at a time and holds the state of the answer being read: status
and headers, then the body, in one of two ways:

- buffered: `read_chunk` takes what arrived since the last call, `next_chunk` one chunk as it
  was parsed with its arrival stamp; reading the socket pauses above `PAUSE_ABOVE` bytes not
  taken, and resumes when they are;
- spliced (`splice`): each chunk handed to the caller's `sink` from httptools' own callback as
  it is parsed, with no future or task step per chunk, and `flush()` called once after each
  socket read that gave the sink something (chunks that arrived together leave together; not
  after the read that ended the body: the caller sends that with the end of its own answer).
  When `flush()` says the consumer is full, reading pauses until `drain()` returns.

Framing is httptools': content-length, chunked (extensions skipped, trailers not taken as
headers), and an answer with neither a length nor chunks, which ends where the server closes
the connection (RFC 9112 section 6.3, the last rule); a chunked or sized answer cut by a close
fails. A head longer than `max_head_bytes`, invalid framing, or an answer nobody asked for (a
second one to one request) fail too. No timer per read unless a read timeout is asked for.

The arrival-time hook: with a `clock`, each socket read is stamped (`arrived`) before it is
parsed, so every chunk of that read carries the time it came in, not the time a waiting
coroutine woke up. The pool of these is `http1.pool.Pool`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

from http1.exceptions import ProtocolError, ReadTimeout

PAUSE_ABOVE = 1 << 20  # bytes of unread body that make a connection stop reading the socket
MAX_HEAD_BYTES = 64 * 1024  # header lines of one answer (names and values)
_LARGE_BODY = 65536  # a request body at least this long is written on its own, not copied after the head


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; holds the state of the answer being read (see the module doc)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        clock: Callable[[], float] | None = None,
        max_head_bytes: int = MAX_HEAD_BYTES,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.clock = clock
        self.max_head_bytes = max_head_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.gone: asyncio.Future[None] | None = None  # done once the transport has let go of its socket
        # The pool's bookkeeping of its origin while the connection belongs to one (opaque here: a
        # connection knows nothing of pools, so http1.pool imports this module and not the reverse).
        self.origin: object | None = None
        self.idle_since = 0.0
        self.arrived = 0.0  # the clock when the last read came in (with a clock)
        self.paused = False
        self.sent = False  # a request went out on this connection (one at a time)
        self._begin()

    def _begin(self) -> None:
        """A fresh parser and answer state, for the next request."""
        if self.paused:
            self._resume()  # (an answer may have ended while its reader was behind)
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0  # the header lines' bytes, counted once count_head (data_received)
        self.read_bytes = 0  # the bytes read while the head was due
        self.count_head = False
        self.head_done = False
        self.body_done = False
        self.keep_alive = False
        self.failure: str | None = None
        self.received = False
        self.chunks: deque[bytes] = deque()
        self.stamps: deque[float] = deque()  # the arrival of each buffered chunk (with a clock)
        self.buffered = 0
        self.sink: Callable[[bytes], None] | None = None  # set while spliced (see splice)
        self.flush: Callable[[], bool] | None = None
        self.sunk = False  # this read gave the sink something to flush
        self.sink_error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.gone = self.loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.received = True
        if not self.head_done:
            # The head's header lines are counted (on_header) only once the reads of this head are
            # over the cap: before that no header can be, and a header costs one Python call less.
            self.read_bytes += len(data)
            if self.read_bytes > self.max_head_bytes and not self.count_head:
                self.count_head = True
                self.head_bytes = sum(len(name) + len(value) for name, value in self.headers)
        clock = self.clock
        if clock is not None:
            self.arrived = clock()  # the arrival time of every chunk in this read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, ProtocolError) else exc
            self._fail(f"invalid HTTP/1.1 answer: {cause}")
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

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if self.sent and not self.body_done and self.failure is None:
            if exc is None and self.head_done and ends_at_close(self.headers):
                self.body_done = True  # a body without a length ends where the connection does
            else:
                self.failure = str(exc) if exc else "the server closed the connection"
        self._wake()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer after a chunked body, or a second answer: not this answer's headers
        if self.count_head:  # only once the reads of this head are over the cap: see data_received
            self.head_bytes += len(name) + len(value)
            if self.head_bytes > self.max_head_bytes:
                raise ProtocolError(f"the answer's header lines are over {self.max_head_bytes} bytes")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.head_done:  # (its header lines were not taken: on_header)
            raise ProtocolError("a second answer to one request (this client does not pipeline)")
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
        if self.clock is not None:
            self.stamps.append(self.arrived)
        self.buffered += len(body)
        if self.buffered > PAUSE_ABOVE:
            self._pause()
        self._wake()

    def on_message_complete(self) -> None:
        self.body_done = True
        self._wake()

    # -- state -----------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.close()
        self._wake()

    def _sink_failed(self, exc: Exception) -> None:
        self.sink = self.flush = None
        self.sink_error = exc
        self.close()
        self._wake()

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
                    raise ReadTimeout(f"the server sent nothing within {timeout:g} s") from None
        finally:
            self._waiter = None

    # -- one request -----------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes = b"") -> None:
        """Write a request: `head` (request line, headers and the blank line) and `body`, in one write
        unless the body is large. One at a time: the answer to the previous one must have ended."""
        if self.closed or self.transport is None:
            raise ProtocolError("the connection is closed")
        if self.sent and not self.body_done:
            raise RuntimeError("this connection still carries an answer: one request at a time (no pipelining)")
        self._begin()
        self.sent = True
        self.transport.write(head + body if len(body) < _LARGE_BODY else head)
        if len(body) >= _LARGE_BODY:
            self.transport.write(body)

    async def read_head(self, timeout: float | None = None) -> None:
        """Wait for the answer's status and headers (`status`, `headers`)."""
        while not self.head_done:
            if self.failure is not None:
                raise ProtocolError(f"the server sent no answer ({self.failure})")
            await self._wait(timeout)

    def _body_failed(self) -> ProtocolError:
        return ProtocolError(f"the answer broke off before its end ({self.failure})")

    def _take(self) -> bytes:
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.stamps.clear()
        self.buffered = 0
        self._resume()
        return data

    async def read_chunk(self, timeout: float | None = None) -> bytes:
        """The body bytes received since the last call (b"" at the end of the body)."""
        while not self.chunks:
            if self.body_done:
                return b""
            if self.failure is not None:
                raise self._body_failed()
            await self._wait(timeout)
        return self._take()

    async def next_chunk(self, timeout: float | None = None) -> tuple[bytes, float] | None:
        """The next body chunk as it was parsed and the time its read arrived (0.0 without a clock);
        None at the end of the body."""
        chunks = self.chunks
        while not chunks:
            if self.body_done:
                return None
            if self.failure is not None:
                raise self._body_failed()
            await self._wait(timeout)
        chunk = chunks.popleft()
        self.buffered -= len(chunk)
        if self.buffered <= PAUSE_ABOVE:
            self._resume()
        return chunk, self.stamps.popleft() if self.stamps else 0.0

    async def splice(
        self,
        sink: Callable[[bytes], None],
        flush: Callable[[], bool] | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Hand the rest of the body to `sink` chunk by chunk, from `on_body`, until it ends.

        `flush()` is called after each read that gave the sink chunks, except the one that ended the
        body (what that read gave is left to the caller, to send with its answer's end). It returns
        True when the consumer is full: reading pauses until `drain()` returns (without a flush,
        reading never pauses). Raises what `read_chunk` raises, and what `sink` or `flush` raised.
        No read timeout: the caller keeps its own."""
        try:
            if self.chunks:
                sink(self._take())
                if flush is not None and flush():
                    self._pause()
            self.sink, self.flush = sink, flush
            while True:
                if self.sink_error is not None:
                    raise self.sink_error
                if self.paused:
                    if drain is not None:
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
        """The answer ended whole and the server keeps the connection open for another request."""
        return self.body_done and self.keep_alive and not self.closed and self.failure is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


def ends_at_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """The answer has neither a length nor chunks: its body is all the server sends before it closes
    (HTTP/1.0 servers, and HTTP/1.1 ones that close; RFC 9112 section 6.3, the last rule)."""
    for name, value in headers:
        name = name.lower()
        if name == b"content-length":
            return False
        if name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            return False
    return True
