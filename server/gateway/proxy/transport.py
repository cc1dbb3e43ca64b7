"""The HTTP client transport to engines: the gateway's side of `http1` (HTTP/1.1 keep-alive on asyncio).

Why not httpx's default transport: httpcore's connection pool rescans every connection (and
polls each idle socket) whenever a request starts or ends, which is quadratic in the number of
open streams (measured here: ~500 us of CPU per streamed chunk at 64 streams, a tenth of the
direct throughput), and its pure-Python HTTP parser plus half a dozen generator layers cost
more per streamed chunk than everything else the gateway does. The proxy calls its `post()`
directly (no httpx Request/Response objects per request); other code uses it as an httpx
transport (`httpx.AsyncClient(transport=UpstreamTransport(...))`). Either way it raises httpx's
exceptions (`http1`'s are translated in one place, `_httpx_error`), and underneath is `http1`:

- one `http1.Connection` (an asyncio protocol) per connection; httptools turns bytes into
  status, headers and body chunks; the request goes out in a single write;
- an `http1.Pool`: per engine a LIFO list of idle keep-alive connections and a bound on the
  open ones; a pooled connection that fails before any answer is retried once on a fresh one;
- no timer per read unless the request asks for a read timeout (the proxy keeps its own
  deadlines); a body the caller does not drain makes the connection pause reading;
- a body can be spliced (`_Body.splice`): each chunk goes to the caller's sink from the
  protocol's own callback as httptools parses it, with no future or task step per chunk.

HTTP/1.1 requests whose answers have a body (POST; GET of a stored response, and the health
checks, model cards and `/metrics` scrapes; no HEAD): that is what engines speak. An answer
with neither a length nor chunks (an HTTP/1.0 server's) ends where the connection does. The
interface the proxy sees is `proxy.upstream.Upstream`.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

import http1

_DEFAULT_PORTS = {b"http": 80, b"https": 443}
_HOP_BY_HOP = frozenset({b"transfer-encoding", b"content-length", b"connection"})

_Origin = http1.Origin  # the connections to one engine (its bound and its idle ones), by its old name


@dataclass(frozen=True, slots=True)
class Target:
    """Where `UpstreamTransport.post` sends: the origin and the request line, computed once."""

    key: http1.Key  # host, port, TLS
    request_line: bytes  # b"POST /v1/... HTTP/1.1\r\nhost: ...\r\n"


def _httpx_error(exc: http1.Http1Error, request: httpx.Request | None) -> httpx.HTTPError:
    """`http1`'s error as the httpx error the proxy's failure table (proxy.failures) knows."""
    message = str(exc)
    if isinstance(exc, http1.ConnectTimeout):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, http1.ConnectError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, http1.ReadTimeout):
        return httpx.ReadTimeout(message, request=request)
    return httpx.RemoteProtocolError(message, request=request)


def _origin_key(url: httpx.URL) -> http1.Key:
    scheme = url.raw_scheme
    return url.raw_host.decode("ascii"), url.port or _DEFAULT_PORTS.get(scheme, 80), scheme == b"https"


class _Body(httpx.AsyncByteStream):
    """An engine's answer: status, headers and the body as it arrives (an `UpstreamResponse`).

    Closing it gives the connection back to the pool, or closes the connection when the answer
    was not read whole (which is how the engine learns that nobody is listening any more).
    """

    def __init__(
        self, connection: http1.Connection, pool: http1.Pool, read_timeout: float | None, request: httpx.Request | None
    ) -> None:
        self._connection = connection
        self._pool = pool
        self._read_timeout = read_timeout
        self._request = request
        self._closed = False
        self.status_code = connection.status
        self.headers = connection.headers

    async def aread(self) -> bytes:
        return b"".join([part async for part in self])

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call; b"" at the end."""
        try:
            return await self._connection.read_chunk(self._read_timeout)
        except http1.Http1Error as exc:
            raise _httpx_error(exc, self._request) from None

    async def splice(
        self, sink: Callable[[bytes], None], flush: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """The rest of the body, each chunk to `sink` as it is parsed (see `http1.Connection.splice`)."""
        try:
            await self._connection.splice(sink, flush, drain)
        except http1.Http1Error as exc:
            raise _httpx_error(exc, self._request) from None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read_chunk, timeout = self._connection.read_chunk, self._read_timeout
        try:
            while True:
                data = await read_chunk(timeout)
                if not data:
                    return
                yield data
        except http1.Http1Error as exc:
            raise _httpx_error(exc, self._request) from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.release(self._connection)


class UpstreamTransport(httpx.AsyncBaseTransport):
    """httpx transport for gateway -> engine traffic (see the module doc)."""

    def __init__(
        self, *, max_connections: int = 1024, keepalive_expiry: float = 30.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._pool = http1.Pool(
            max_connections=max_connections, keepalive_expiry=keepalive_expiry, ssl_context=ssl_context
        )

    @property
    def _origins(self) -> dict[http1.Key, http1.Origin]:
        return self._pool.origins

    def idle_connections(self) -> int:
        """Keep-alive connections waiting in the pool (for tests and diagnostics)."""
        return self._pool.idle_connections()

    def target(self, url: str, method: str = "POST") -> Target:
        """`method url` parsed once, for `post`."""
        parsed = httpx.URL(url)
        host = parsed.raw_host
        host_header = host if parsed.port is None else host + b":" + str(parsed.port).encode()
        return Target(
            _origin_key(parsed),
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
        sent: Callable[[], object] | None = None,
    ) -> _Body:
        """Send `body` to `target` (a POST unless the target says otherwise); the answer once its headers
        arrived (raises httpx's exceptions). `sent` is called once the request is written, while the
        engine works on it."""
        lines = [target.request_line]
        for name, value in headers:
            lines += [name, b": ", value, b"\r\n"]
        lines += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n"]
        return await self._exchange(target.key, b"".join(lines), body, connect_timeout, read_timeout, None, sent)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The same, for an httpx.AsyncClient built on this transport (health checks, /tokenize)."""
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        head, body = await _serialize(request)
        answer = await self._exchange(
            _origin_key(request.url), head, body, timeouts.get("connect"), timeouts.get("read"), request
        )
        return httpx.Response(
            status_code=answer.status_code,
            headers=answer.headers,
            stream=answer,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _exchange(
        self,
        key: http1.Key,
        head: bytes,
        body: bytes,
        connect_timeout: float | None,
        read_timeout: float | None,
        request: httpx.Request | None,
        sent: Callable[[], object] | None = None,
    ) -> _Body:
        try:
            connection = await self._pool.request(
                key, head, body, connect_timeout=connect_timeout, read_timeout=read_timeout, sent=sent
            )
        except http1.Http1Error as exc:
            raise _httpx_error(exc, request) from None
        return _Body(connection, self._pool, read_timeout, request)

    async def aclose(self) -> None:
        await self._pool.aclose()


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
