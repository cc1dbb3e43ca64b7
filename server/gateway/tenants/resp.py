"""A minimal Redis client for the quota store: one pipelined connection, RESP2, scripts.

Why not redis-py's asyncio client: it cost ~240 us of CPU per request (an admission and a
settlement, bench/quota_bench.py), more than the rest of the gateway's work on a request. Here
a command is one `write` on the connection and its answer is matched in order from what the
connection reads (`data_received`), so concurrent requests share one connection without a pool
or a lock, and a burst opens no connections.

A command not answered within `timeout` seconds aborts the connection (one timer per connection,
not one per command): every command waiting on it fails with ConnectionError, and the next one
connects again (AUTH and SELECT from the URL). `redis://[[user]:password@]host[:port][/db]`,
`rediss://` (TLS), `unix:///path[?db=N]`. Errors name the host and port, never the password.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


class RespError(Exception):
    """An error answer of the server (`-ERR ...`, `-NOSCRIPT ...`)."""


class _Incomplete(Exception):
    pass


def encode(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse(buf: bytearray | bytes, pos: int) -> tuple[Any, int]:
    """One answer at `pos`: (value, position after it); _Incomplete if `buf` does not hold it all."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == b"+":
        return line.decode(), pos
    if kind == b"-":
        return RespError(line.decode()), pos
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return bytes(buf[pos : pos + size]).decode(), pos + size + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    raise ConnectionError(f"not a Redis answer (it starts with {bytes(kind)!r})")


class _Connection(asyncio.Protocol):
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.transport: asyncio.BaseTransport | None = None
        self.pending: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.buffer = bytearray()
        self.closed = False
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses

    def send(self, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        if self.closed or self.transport is None:
            raise ConnectionError("the connection to Redis is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.pending.append((future, time.monotonic()))
        self.transport.write(encode(args))  # type: ignore[attr-defined]
        if self.watchdog is None:
            self.watchdog = loop.call_later(self.timeout, self._check)
        return future

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = parse(buf, pos)
                future, _ = self.pending.popleft()
                if not future.done():
                    if isinstance(value, RespError):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
        except _Incomplete:
            pass
        except (ConnectionError, IndexError, ValueError) as exc:
            self._fail(ConnectionError(f"Redis sent what this client cannot read: {exc}"))
            return
        del buf[:pos]

    def _check(self) -> None:
        self.watchdog = None
        if not self.pending:
            return
        waited = time.monotonic() - self.pending[0][1]
        if waited >= self.timeout:
            self._fail(TimeoutError(f"no answer from Redis within {self.timeout:g} s"))
        else:
            self.watchdog = asyncio.get_running_loop().call_later(self.timeout - waited, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the connection to Redis was lost ({exc or 'closed by the server'})"))

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        while self.pending:
            future, _ = self.pending.popleft()
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]


class RespClient:
    """Commands to one Redis server over one connection (see the module doc)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("not a redis://, rediss:// or unix:// URL")
        self.scheme, self.timeout = parts.scheme, timeout
        self.host, self.port, self.path = parts.hostname or "localhost", parts.port or 6379, parts.path
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        db = parse_qs(parts.query).get("db", ["0"])[0] if parts.scheme == "unix" else parts.path.strip("/") or "0"
        self.db = int(db)
        self._connection: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    async def call(self, *args: Any) -> Any:
        connection = self._connection
        if connection is None or connection.closed:
            connection = await self._connect()
        return await connection.send(args)

    async def _connect(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        connection = _Connection(self.timeout)
        if self.scheme == "unix":
            opening = loop.create_unix_connection(lambda: connection, self.path)
        else:
            tls = ssl.create_default_context() if self.scheme == "rediss" else None
            opening = loop.create_connection(lambda: connection, self.host, self.port, ssl=tls)
        try:
            await asyncio.wait_for(opening, self.timeout)
        except TimeoutError:
            raise TimeoutError(f"no connection to Redis within {self.timeout:g} s") from None
        try:
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                await asyncio.wait_for(connection.send(("AUTH", *auth)), self.timeout)
            if self.db:
                await asyncio.wait_for(connection.send(("SELECT", self.db)), self.timeout)
        except BaseException:
            connection._fail(ConnectionError("closed"))
            raise
        self._connection = connection
        return connection

    def script(self, source: str) -> Script:
        return Script(self, source)

    async def aclose(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection._fail(ConnectionError("the client was closed"))


class Script:
    """A Lua script sent by its SHA-1 (EVALSHA), and whole the first time a server lacks it."""

    def __init__(self, client: RespClient, source: str) -> None:
        self.client, self.source = client, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: tuple[Any, ...]) -> Any:
        try:
            return await self.client.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            return await self.client.call("EVAL", self.source, len(keys), *keys, *args)
