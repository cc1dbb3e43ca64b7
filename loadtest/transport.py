"""HTTP/1.1 for the load tester: `http1`'s keep-alive pool, with every read stamped on arrival.

Why not httpx: measured with `loadtest.selfcheck` (loadtest/results/client-overhead), an httpx
pool in one process added a median 36 ms to the TTFT at 32 streams and 566 ms at 256 (httpcore
rescans its whole pool whenever a request starts or ends, and reads go through layers of
generators). Here, through `http1` (asyncio + httptools, the client the gateway uses too; it
imports nothing of the gateway):

- **every body chunk is stamped on arrival**, in `data_received` (the loop's callback for that
  socket read; http1's clock hook), so the time a waiting coroutine needs to wake up is not
  counted as latency;
- idle keep-alive connections in a LIFO list (O(1) take and give back), at most
  `max_connections` open at once to each origin (a load test points one client at one
  server); a reused connection that fails before any answer byte is retried once on a new one
  (the server closed it while idle; the request never reached it).

`http://` and `https://` (the system's CA certificates, no client certificates). Errors:
`ConnectError` (no connection), `ProtocolError` (the connection broke or the answer was not
HTTP); both subclass `TransportError` (http1's own exceptions, by the names the load tester uses).
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Self

import http1
from http1 import ConnectError, ProtocolError
from http1 import Http1Error as TransportError

__all__ = ["ConnectError", "HTTPClient", "ProtocolError", "Response", "TransportError"]


class Response:
    """An answer being read: status and headers first, then body chunks with arrival times."""

    def __init__(self, pool: http1.Pool, connection: http1.Connection) -> None:
        self._pool = pool
        self._connection: http1.Connection | None = connection
        self.status_code = connection.status
        # names in lower case
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in connection.headers}
        self.arrived = connection.arrived  # when the read that completed the head came in

    async def next_chunk(self) -> tuple[bytes, float] | None:
        """The next body chunk and the time its read arrived; None at the end of the body."""
        connection = self._connection
        if connection is None:
            return None
        return await connection.next_chunk()

    async def drain(self) -> None:
        """Read (and drop) the rest of the body, so the connection can serve the next request.

        After `data: [DONE]` only the chunked-encoding terminator is left; without reading it
        the connection would have to be closed and the next request would pay a new connect.
        A connection that breaks meanwhile is simply not reused.
        """
        connection = self._connection
        if connection is None:
            return
        with contextlib.suppress(TransportError):
            while await connection.read_chunk():
                pass

    async def aclose(self) -> None:
        """Give the connection back (answer complete) or close it (answer cut short)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)


class HTTPClient:
    """Posts to one or more `http://` or `https://` origins over pooled keep-alive connections."""

    def __init__(
        self,
        *,
        max_connections: int | None = None,
        connect_timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._pool = http1.Pool(max_connections=max_connections, ssl_context=tls, clock=clock)
        self._targets: dict[str, tuple[http1.Key, bytes]] = {}

    @property
    def _open(self) -> set[http1.Connection]:
        return self._pool.open

    @property
    def _idle(self) -> dict[http1.Key, list[http1.Connection]]:
        return {key: origin.idle for key, origin in self._pool.origins.items()}

    def _target(self, url: str) -> tuple[http1.Key, bytes]:
        target = self._targets.get(url)
        if target is None:
            try:
                target = self._targets[url] = http1.request_start(url)
            except ValueError as exc:
                raise ConnectError(str(exc)) from None
        return target

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> Response:
        """Send one POST; returns once the status line and headers have arrived."""
        key, start = self._target(url)
        head = http1.request_head(start, headers.items(), len(body))
        connection = await self._pool.request(key, head, body, connect_timeout=self._connect_timeout_s)
        return Response(self._pool, connection)

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
