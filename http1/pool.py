"""Keep-alive connections per origin, a bound on how many are open, and one request's exchange.

- per origin (host, port, TLS) a LIFO list of idle connections: take and give back are O(1);
  closed ones, and ones idle longer than `keepalive_expiry`, are dropped when taken;
- per origin a bound on open connections: a counter and a FIFO of waiters (an
  asyncio.Semaphore's semantics) so a request under the bound takes a slot without a coroutine
  or a lock's bookkeeping, and one over it waits its turn;
- a pooled connection that fails before any answer byte is retried once on a fresh one (the
  server closed it while it was idle; the request never reached it);
- `aclose` closes every open connection and waits (bounded) until their transports let go of
  their sockets (a TLS one after its close_notify), so a loop that ends right after leaves no
  socket behind.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable

from http1.connection import Connection
from http1.exceptions import ConnectError, ConnectTimeout, ProtocolError

Key = tuple[str, int, bool]  # host, port, TLS


class Origin:
    """The connections to one origin: idle ones (LIFO) and the bound on how many are open."""

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


class Pool:
    """Keep-alive HTTP/1.1 connections to any number of origins (see the module doc).

    `max_connections` bounds the open connections per origin (None: no bound); `clock`, when
    given, stamps every socket read of every connection (`Connection.arrived`, `next_chunk`).
    """

    def __init__(
        self,
        *,
        max_connections: int | None = None,
        keepalive_expiry: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.ssl_context = ssl_context  # for TLS origins; the system's CA certificates when None
        self.clock = clock
        self.origins: dict[Key, Origin] = {}
        self.open: set[Connection] = set()  # until their transports are gone

    def idle_connections(self) -> int:
        """Keep-alive connections waiting for a request (for tests and diagnostics)."""
        return sum(len(origin.idle) for origin in self.origins.values())

    async def request(
        self,
        key: Key,
        head: bytes,
        body: bytes,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        sent: Callable[[], object] | None = None,
    ) -> Connection:
        """Send one request to `key` and return its connection once the answer's head arrived;
        `sent` is called once the request is written, while the server works on it (again if a
        stale keep-alive connection made it send once more).

        The connection holds a slot of its origin until `release(connection)`; read its body first.
        Raises ConnectError, ConnectTimeout, ReadTimeout (the head, with a `read_timeout`) or ProtocolError.
        """
        origin = self.origins.get(key)
        if origin is None:
            bound = self.max_connections if self.max_connections is not None else sys.maxsize
            origin = self.origins[key] = Origin(bound)
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
                    connection = await self._connect(key, origin, connect_timeout)
                try:
                    connection.send(head, body)
                    if sent is not None:
                        sent()
                    await connection.read_head(read_timeout)
                    return connection
                except ProtocolError:
                    connection.close()
                    if not reused or connection.received:
                        raise
                    connection, reused = None, False  # it went stale in the pool: once more, fresh
        except BaseException:
            if connection is not None:
                connection.close()
            origin.release()
            raise

    def release(self, connection: Connection) -> None:
        """Give the connection back (its answer ended whole) or close it (cut short: the server learns
        that nobody is listening any more), and its slot to the next request."""
        origin = connection.origin
        assert isinstance(origin, Origin), "a connection of this pool"
        if connection.reusable():
            connection.idle_since = time.monotonic()
            origin.idle.append(connection)
        else:
            connection.close()
        origin.release()

    def _take_idle(self, origin: Origin) -> Connection | None:
        now = time.monotonic()
        expiry = self.keepalive_expiry
        idle = origin.idle
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if (
                not connection.closed
                and transport is not None
                and not transport.is_closing()
                and (expiry is None or now - connection.idle_since < expiry)
            ):
                return connection
            connection.close()
        return None

    async def _connect(self, key: Key, origin: Origin, timeout: float | None) -> Connection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            if self.ssl_context is None:
                self.ssl_context = ssl.create_default_context()
            context = self.ssl_context
        clock = self.clock
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: Connection(loop, clock=clock),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            within = f" within {timeout:g} s" if timeout is not None else ""
            raise ConnectTimeout(f"no connection to {host}:{port}{within}") from None
        except OSError as exc:
            raise ConnectError(f"{host}:{port}: {exc.strerror or exc}") from None
        connection.origin = origin
        self.open.add(connection)
        if connection.gone is not None:
            connection.gone.add_done_callback(lambda _: self.open.discard(connection))
        return connection

    async def aclose(self) -> None:
        """Close every connection, and wait (at most 2 s) for their transports to let go of their sockets."""
        for origin in self.origins.values():
            origin.idle.clear()
        open_ = list(self.open)
        for connection in open_:
            connection.close()
        gone = [c.gone for c in open_ if c.gone is not None and not c.gone.done()]
        if gone:
            await asyncio.wait(gone, timeout=2.0)
            for connection in open_:
                if connection.gone is not None and not connection.gone.done() and connection.transport is not None:
                    connection.transport.abort()
            await asyncio.sleep(0)
        self.open.clear()
