"""The HTTP client transport to engines: httpcore's HTTP/1.1, an O(1) pool, plain asyncio sockets.

Why not httpx's default transport: httpcore's connection pool rescans every connection (and
polls each idle socket) whenever a request starts or ends, which is quadratic in the number
of open streams; measured here it cost ~500 us of CPU per streamed chunk at 64 streams and
collapsed throughput to a tenth of direct. Its anyio network layer also opens a cancel scope
around every socket read. This transport keeps httpx's API for the rest of the gateway
(`httpx.AsyncClient(transport=UpstreamTransport(...))`, `httpx.Response.aiter_raw`, httpx's
exceptions), and underneath:

- per origin a LIFO list of idle keep-alive connections (take and give back are O(1); stale
  ones are dropped when taken) and a semaphore bounding the open connections;
- a connection that was idle in the pool and fails before any answer is retried once on a
  fresh connection (the engine closed it while idle; the request never reached it);
- sockets from `asyncio.open_connection` (TCP_NODELAY is asyncio's default); a read has no
  timer unless the request asks for a read timeout (the proxy's own deadlines do that work).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

_DEFAULT_PORTS = {b"http": 80, b"https": 443}
# httpcore's exceptions and httpx's have the same names.
_MAP = {name: getattr(httpx, name) for name in (
    "ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout", "WriteError", "WriteTimeout",
    "PoolTimeout", "RemoteProtocolError", "LocalProtocolError", "UnsupportedProtocol",
)}
_STALE = (httpcore.RemoteProtocolError, httpcore.ReadError, httpcore.WriteError, httpcore.ConnectionNotAvailable)


def _mapped(exc: Exception, request: httpx.Request) -> httpx.TransportError:
    kind = _MAP.get(type(exc).__name__)
    if kind is None:
        kind = httpx.TimeoutException if isinstance(exc, httpcore.TimeoutException) else httpx.TransportError
    return kind(str(exc) or type(exc).__name__, request=request)  # type: ignore[call-arg]


class _SocketStream(httpcore.AsyncNetworkStream):
    """An asyncio connection as httpcore's network stream."""

    __slots__ = ("_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("read timed out") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout("write timed out") from None
        except OSError as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from None

    async def aclose(self) -> None:
        self._writer.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle keep-alive socket with data or EOF: the server hung up
            return self._reader.at_eof() or self._writer.transport.is_closing()
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info in ("client_addr", "server_addr"):
            return self._writer.get_extra_info("sockname" if info == "client_addr" else "peername")
        return None


async def _connect(origin: httpcore.Origin, timeout: float | None, ssl_context: ssl.SSLContext | None) -> _SocketStream:
    host = origin.host.decode("ascii")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, origin.port, ssl=ssl_context if origin.scheme == b"https" else None,
                limit=2**20,
            )
    except TimeoutError:
        raise httpcore.ConnectTimeout(f"connecting to {host}:{origin.port} timed out") from None
    except OSError as exc:
        raise httpcore.ConnectError(f"{host}:{origin.port}: {exc.strerror or exc}") from None
    return _SocketStream(reader, writer)


class _Origin:
    """The pool of one origin: idle connections (LIFO) and a bound on open ones."""

    __slots__ = ("idle", "slots")

    def __init__(self, max_connections: int) -> None:
        self.idle: list[httpcore.AsyncHTTP11Connection] = []
        self.slots = asyncio.Semaphore(max_connections)


class _PooledBody(httpx.AsyncByteStream):
    """The response body; closing it gives the connection back (or drops it if it cannot be reused)."""

    __slots__ = ("_stream", "_connection", "_origin", "_request", "_closed")

    def __init__(self, stream: Any, connection: httpcore.AsyncHTTP11Connection, origin: _Origin,
                 request: httpx.Request) -> None:
        self._stream = stream
        self._connection = connection
        self._origin = origin
        self._request = request
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except httpcore.ProtocolError as exc:
            raise _mapped(exc, self._request) from None
        except (httpcore.NetworkError, httpcore.TimeoutException) as exc:
            raise _mapped(exc, self._request) from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()  # httpcore: IDLE if the answer was read whole, else closed
        finally:
            if self._connection.is_idle():
                self._origin.idle.append(self._connection)
            self._origin.slots.release()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """httpx transport for gateway -> engine traffic (see the module doc)."""

    def __init__(self, *, max_connections: int = 1024, keepalive_expiry: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.ssl_context = ssl_context
        self._origins: dict[tuple[bytes, bytes, int], _Origin] = {}

    def idle_connections(self) -> int:
        """Keep-alive connections waiting in the pool (for tests and diagnostics)."""
        return sum(len(o.idle) for o in self._origins.values())

    @staticmethod
    async def _take_idle(pool: _Origin) -> httpcore.AsyncHTTP11Connection | None:
        while pool.idle:
            connection = pool.idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await connection.aclose()
        return None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.raw_scheme
        port = url.port or _DEFAULT_PORTS.get(scheme, 80)
        key = (scheme, url.raw_host, port)
        pool = self._origins.get(key)
        if pool is None:
            pool = self._origins[key] = _Origin(self.max_connections)
        origin = httpcore.Origin(scheme, url.raw_host, port)
        timeouts = request.extensions.get("timeout", {})
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,  # type: ignore[arg-type]
            extensions=request.extensions,
        )
        await pool.slots.acquire()
        try:
            connection = await self._take_idle(pool)
            reused = connection is not None
            while True:
                if connection is None:
                    try:
                        stream = await _connect(origin, timeouts.get("connect"), self.ssl_context)
                    except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                        raise _mapped(exc, request) from None
                    connection = httpcore.AsyncHTTP11Connection(origin, stream, keepalive_expiry=self.keepalive_expiry)
                try:
                    response = await connection.handle_async_request(core_request)
                    break
                except _STALE as exc:
                    await connection.aclose()
                    if not reused:
                        raise _mapped(exc, request) from None
                    connection, reused = None, False  # it went stale in the pool: once more, fresh
                except (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError) as exc:
                    await connection.aclose()
                    raise _mapped(exc, request) from None
                except BaseException:
                    await connection.aclose()
                    raise
        except BaseException:
            pool.slots.release()
            raise
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_PooledBody(response.stream, connection, pool, request),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        for pool in self._origins.values():
            while pool.idle:
                await pool.idle.pop().aclose()
