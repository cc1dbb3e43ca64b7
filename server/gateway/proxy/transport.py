"""The HTTP client transport to engines: HTTP/1.1 keep-alive on asyncio, parsed by httptools.

Why not httpx's default transport: httpcore's connection pool rescans every connection (and
polls each idle socket) whenever a request starts or ends, which is quadratic in the number of
open streams (measured here: ~500 us of CPU per streamed chunk at 64 streams, a tenth of the
direct throughput), and its pure-Python HTTP parser plus half a dozen generator layers cost
more per streamed chunk than everything else the gateway does. The proxy calls its `post()`
directly (no httpx Request/Response objects per request); other code uses it as an httpx
transport (`httpx.AsyncClient(transport=UpstreamTransport(...))`). Either way it raises httpx's
exceptions, and underneath:

- one `asyncio.Protocol` per connection (connection.py); httptools (the C parser uvicorn uses)
  turns bytes into status, headers and body chunks; the request goes out in a single write;
- per origin a LIFO list of idle keep-alive connections (take and give back are O(1); closed or
  expired ones are dropped when taken) and a semaphore bounding the open connections;
- a pooled connection that fails before any answer is retried once on a fresh one (the engine
  closed it while it was idle; the request never reached it);
- no timer per read unless the request asks for a read timeout (the proxy keeps its own
  deadlines); a body the caller does not drain makes the connection pause reading;
- a body can be spliced (`_Body.splice`, connection.py): each chunk goes to the caller's sink
  from the protocol's own callback as httptools parses it, with no future or task step per chunk.

HTTP/1.1 requests whose answers have a body (POST; GET of a stored response, and the health
checks, model cards and `/metrics` scrapes; no HEAD): that is what engines speak. An answer
with neither a length nor chunks (an HTTP/1.0 server's) ends where the connection does. The
interface the proxy sees is `proxy.upstream.Upstream`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from server.gateway.proxy.connection import Connection

_DEFAULT_PORTS = {b"http": 80, b"https": 443}
_HOP_BY_HOP = frozenset({b"transfer-encoding", b"content-length", b"connection"})


@dataclass(frozen=True, slots=True)
class Target:
    """Where `UpstreamTransport.post` sends: the origin and the request line, computed once."""

    key: tuple[bytes, bytes, int]
    host: str
    request_line: bytes  # b"POST /v1/... HTTP/1.1\r\nhost: ...\r\n"


class _Origin:
    """The connections to one engine: idle ones (LIFO) and a bound on how many are open.

    The bound is a counter and a FIFO of waiters (an asyncio.Semaphore's semantics): a request
    under the bound takes a slot without a coroutine or a lock's bookkeeping; one over it waits its turn.
    """

    __slots__ = ("free", "idle", "waiters")

    def __init__(self, max_connections: int) -> None:
        self.idle: list[Connection] = []
        self.free = max_connections
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def wait_for_slot(self) -> None:
        """Wait until `release` hands this request a slot (called when `free` is 0)."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as it was cancelled: pass it on
            elif waiter in self.waiters:  # (a release may have dropped it already, cancelled)
                self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        """A request gave its slot back: to the first waiter still waiting, else to the counter."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class _Body(httpx.AsyncByteStream):
    """An engine's answer: status, headers and the body as it arrives (an `UpstreamResponse`).

    Closing it gives the connection back to the pool, or closes the connection when the answer
    was not read whole (which is how the engine learns that nobody is listening any more).
    """

    def __init__(self, connection: Connection, origin: _Origin, read_timeout: float | None) -> None:
        self._connection = connection
        self._origin = origin
        self._read_timeout = read_timeout
        self._closed = False
        self.status_code = connection.status
        self.headers = connection.headers

    async def aread(self) -> bytes:
        return b"".join([part async for part in self])

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call; b"" at the end."""
        return await self._connection.read_chunk(self._read_timeout)

    async def splice(
        self, sink: Callable[[bytes], None], flush: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """The rest of the body, each chunk to `sink` as it is parsed (see `Connection.splice`)."""
        await self._connection.splice(sink, flush, drain)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read_chunk, timeout = self._connection.read_chunk, self._read_timeout
        while True:
            data = await read_chunk(timeout)
            if not data:
                return
            yield data

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection.reusable():
            connection.idle_since = time.monotonic()
            connection.request = None
            self._origin.idle.append(connection)
        else:
            connection.close()
        self._origin.release()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """httpx transport for gateway -> engine traffic (see the module doc)."""

    def __init__(
        self, *, max_connections: int = 1024, keepalive_expiry: float = 30.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.ssl_context = ssl_context
        self._origins: dict[tuple[bytes, bytes, int], _Origin] = {}

    def idle_connections(self) -> int:
        """Keep-alive connections waiting in the pool (for tests and diagnostics)."""
        return sum(len(o.idle) for o in self._origins.values())

    def _take_idle(self, origin: _Origin) -> Connection | None:
        now = time.monotonic()
        while origin.idle:
            connection = origin.idle.pop()
            transport = connection.transport
            if (
                not connection.closed
                and transport is not None
                and not transport.is_closing()
                and now - connection.idle_since < self.keepalive_expiry
            ):
                return connection
            connection.close()
        return None

    async def _connect(
        self, scheme: bytes, host: str, port: int, timeout: float | None, request: httpx.Request | None
    ) -> Connection:
        loop = asyncio.get_running_loop()
        tls = scheme == b"https"
        context = (self.ssl_context or ssl.create_default_context()) if tls else None
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: Connection(loop), host, port, ssl=context, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(f"{host}:{port}: {exc.strerror or exc}", request=request) from None
        return connection

    def target(self, url: str, method: str = "POST") -> Target:
        """`method url` parsed once, for `post`."""
        parsed = httpx.URL(url)
        scheme, host = parsed.raw_scheme, parsed.raw_host
        port = parsed.port or _DEFAULT_PORTS.get(scheme, 80)
        host_header = host if parsed.port is None else host + b":" + str(port).encode()
        return Target(
            (scheme, host, port),
            host.decode("ascii"),
            method.encode("ascii") + b" " + parsed.raw_path + b" HTTP/1.1\r\nhost: " + host_header + b"\r\n",
        )

    async def post(
        self,
        target: Target,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
    ) -> _Body:
        """Send `body` to `target` (a POST unless the target says otherwise); the answer once its headers
        arrived (raises httpx's exceptions)."""
        lines = [target.request_line]
        for name, value in headers:
            lines += [name, b": ", value, b"\r\n"]
        lines += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n"]
        return await self._exchange(target.key, target.host, b"".join(lines), body, connect_timeout, read_timeout, None)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The same, for an httpx.AsyncClient built on this transport (health checks, /tokenize)."""
        url = request.url
        scheme, host = url.raw_scheme, url.raw_host
        port = url.port or _DEFAULT_PORTS.get(scheme, 80)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        head, body = await _serialize(request)
        answer = await self._exchange(
            (scheme, host, port),
            host.decode("ascii"),
            head,
            body,
            timeouts.get("connect"),
            timeouts.get("read"),
            request,
        )
        return httpx.Response(
            status_code=answer.status_code,
            headers=answer.headers,
            stream=answer,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _exchange(
        self,
        key: tuple[bytes, bytes, int],
        host: str,
        head: bytes,
        body: bytes,
        connect_timeout: float | None,
        read_timeout: float | None,
        request: httpx.Request | None,
    ) -> _Body:
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = _Origin(self.max_connections)
        if origin.free:
            origin.free -= 1
        else:
            await origin.wait_for_slot()
        connection = None
        try:
            connection = self._take_idle(origin)
            reused = connection is not None
            while True:
                if connection is None:
                    connection = await self._connect(key[0], host, key[2], connect_timeout, request)
                connection.send(request, head, body)
                try:
                    await connection.read_head(read_timeout)
                    break
                except httpx.RemoteProtocolError:
                    connection.close()
                    if not reused or connection.received:
                        raise
                    connection, reused = None, False  # it went stale in the pool: once more, fresh
        except BaseException:
            if connection is not None:
                connection.close()
            origin.release()
            raise
        return _Body(connection, origin, read_timeout)

    async def aclose(self) -> None:
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()


async def _serialize(request: httpx.Request) -> tuple[bytes, bytes]:
    """The request line and headers, and the body, with a content-length (never chunked)."""
    try:
        body = request.content
    except httpx.RequestNotRead:
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
    url = request.url
    lines = [request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        if name.lower() not in _HOP_BY_HOP:
            lines += [name, b": ", value, b"\r\n"]
    if body or request.method not in ("GET", "HEAD"):
        lines += [b"Content-Length: ", str(len(body)).encode(), b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines), body
