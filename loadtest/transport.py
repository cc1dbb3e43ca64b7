"""HTTP/1.1 for the load tester: keep-alive connections on asyncio, parsed by httptools.

Why not httpx: measured with `loadtest.selfcheck` (loadtest/results/client-overhead), an httpx
pool in one process added a median 36 ms to the TTFT at 32 streams and 566 ms at 256 (httpcore
rescans its whole pool whenever a request starts or ends, and reads go through layers of
generators). Here:

- one `asyncio.Protocol` per connection; httptools (the C parser uvicorn uses) turns bytes into
  status, headers and body chunks; the request goes out in a single write;
- **every body chunk is stamped on arrival**, in `data_received` (the loop's callback for that
  socket read), so the time a waiting coroutine needs to wake up is not counted as latency;
- idle keep-alive connections in a LIFO list (O(1) take and give back), at most
  `max_connections` open at once; a reused connection that fails before any answer byte is
  retried once on a new one (the server closed it while idle; the request never reached it).

`http://` and `https://` (the system's CA certificates, no client certificates). Errors:
`ConnectError` (no connection), `ProtocolError` (the connection broke or the answer was not
HTTP); both subclass `TransportError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Self
from urllib.parse import urlsplit

import httptools


class TransportError(Exception):
    """A request failed below HTTP: ConnectError or ProtocolError."""


class ConnectError(TransportError):
    """No connection to the server (refused, unreachable, DNS)."""


class ProtocolError(TransportError):
    """The connection broke, or what came back was not a valid HTTP/1.1 answer."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the answer being read on it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future | None = None
        self.gone: asyncio.Future | None = None  # done once the transport has let go of its socket
        self.reset()

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.keep_alive = False
        self.body_done = False
        self.failure: str | None = None
        self.received = False
        self.chunks: deque[tuple[bytes, float]] = deque()
        self._now = 0.0

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.gone = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._now = self.clock()  # the arrival time of every chunk in this read
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.failure = f"invalid HTTP answer: {exc}"
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if not self.body_done and self.failure is None:
            if exc is None and self.head_done and not self.headers.keys() & {"content-length", "transfer-encoding"}:
                self.body_done = True  # no length, no chunks: the body is all the server sent (RFC 9112 6.3)
            else:
                self.failure = str(exc) if exc else "the server closed the connection"
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # only valid until the message ends
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append((body, self._now))

    def on_message_complete(self) -> None:
        self.body_done = True

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def reusable(self) -> bool:
        return self.body_done and self.keep_alive and not self.closed and self.failure is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class Response:
    """An answer being read: status and headers first, then body chunks with arrival times."""

    def __init__(self, pool: HTTPClient, connection: _Connection) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status_code = connection.status
        self.headers = connection.headers  # names in lower case
        self.arrived = connection._now  # when the read that completed the head came in

    async def next_chunk(self) -> tuple[bytes, float] | None:
        """The next body chunk and the time its read arrived; None at the end of the body."""
        connection = self._connection
        if connection is None:
            return None
        while not connection.chunks:
            if connection.body_done:
                return None
            if connection.failure is not None:
                raise ProtocolError(f"the connection broke mid-answer ({connection.failure})")
            await connection.wait()
        return connection.chunks.popleft()

    async def drain(self) -> None:
        """Read (and drop) the rest of the body, so the connection can serve the next request.

        After `data: [DONE]` only the chunked-encoding terminator is left; without reading it
        the connection would have to be closed and the next request would pay a new connect.
        """
        connection = self._connection
        while connection is not None and not connection.body_done:
            if connection.failure is not None or connection.closed:
                return
            connection.chunks.clear()
            await connection.wait()

    async def aclose(self) -> None:
        """Give the connection back (answer complete) or close it (answer cut short)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool._release(connection)


class HTTPClient:
    """Posts to one or more `http://` origins over pooled keep-alive connections."""

    def __init__(
        self,
        *,
        max_connections: int | None = None,
        connect_timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._clock = clock
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._tls = tls  # for https://; the system's CA certificates when None
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes]] = {}
        self._open: set[_Connection] = set()
        self._closing: set[_Connection] = set()  # closed, their transports not yet gone
        self._keys: dict[_Connection, tuple[str, int, bool]] = {}

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectError(f"not an http:// or https:// URL: {url!r}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
            head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
            target = self._targets[url] = ((parts.hostname, port, tls), head)
        return target

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> Response:
        """Send one POST; returns once the status line and headers have arrived."""
        key, head = self._target(url)
        request = head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        request += b"content-length: %d\r\n\r\n" % len(body) + body
        if self._slots is not None:
            await self._slots.acquire()
        try:
            connection, reused = await self._take(key)
            try:
                return await self._exchange(connection, request)
            except ProtocolError:
                if not reused or connection.received:
                    raise
            connection, _ = await self._take(key, fresh=True)  # stale keep-alive: retry once
            return await self._exchange(connection, request)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise

    async def _exchange(self, connection: _Connection, request: bytes) -> Response:
        connection.reset()
        try:
            connection.transport.write(request)
            while not connection.head_done:
                if connection.failure is not None:
                    raise ProtocolError(f"no answer from the server ({connection.failure})")
                await connection.wait()
        except BaseException:
            self._drop(connection)
            raise
        return Response(self, connection)

    async def _take(self, key: tuple[str, int, bool], fresh: bool = False) -> tuple[_Connection, bool]:
        idle = self._idle.setdefault(key, [])
        while idle and not fresh:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
            self._forget(connection)
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._clock), host, port, ssl=self._tls if tls else None
                )
        except TimeoutError:
            raise ConnectError(f"no connection to {key[0]}:{key[1]} within {self._connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectError(f"{type(exc).__name__}: {exc}") from exc
        self._open.add(connection)
        self._keys[connection] = key
        return connection, False

    def _release(self, connection: _Connection) -> None:
        if connection.reusable():
            self._idle[self._keys[connection]].append(connection)
        else:
            self._drop(connection)
        if self._slots is not None:
            self._slots.release()

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._forget(connection)
        self._track_closing(connection)

    def _track_closing(self, connection: _Connection) -> None:
        """A closed connection whose transport may still be shutting down (TLS close_notify)."""
        gone = connection.gone
        if gone is not None and not gone.done():
            self._closing.add(connection)
            gone.add_done_callback(lambda _: self._closing.discard(connection))

    def _forget(self, connection: _Connection) -> None:
        self._open.discard(connection)
        self._keys.pop(connection, None)

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
            self._track_closing(connection)
        self._open.clear()
        self._idle.clear()
        # A transport lets go of its socket on a later turn of the loop (a TLS one after its
        # close_notify): wait for that, bounded, or a loop that ends right after this leaves the
        # sockets open (a ResourceWarning in whatever collects them).
        closing = [c for c in self._closing if c.gone is not None]
        if closing:
            await asyncio.wait([c.gone for c in closing if c.gone is not None], timeout=2.0)
            for connection in closing:
                if not connection.closed and connection.transport is not None:
                    connection.transport.abort()
            await asyncio.sleep(0)
        self._closing.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
