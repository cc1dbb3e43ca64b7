"""http1.Pool over real sockets: keep-alive reuse, stale connections, the bound, errors, closing."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from http1 import ConnectError, Pool, ProtocolError, ReadTimeout, request_head, request_start
from tests.support import async_wait_for, refusing_port

HELLO = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    return head + await reader.readexactly(int(length.group(1)) if length else 0)


@contextlib.asynccontextmanager
async def server(handle):
    """A loopback server running `handle(reader, writer, index)` for its index-th connection (from 0)."""
    connections: list[int] = []

    async def run(reader, writer):
        connections.append(len(connections))
        try:
            await handle(reader, writer, connections[-1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(run, "127.0.0.1", 0)
    try:
        yield ("127.0.0.1", srv.sockets[0].getsockname()[1], False), connections
    finally:
        srv.close()


def post(key, body: bytes = b"x") -> tuple[bytes, bytes]:
    _, start = request_start(f"http://{key[0]}:{key[1]}/v1/completions")
    return request_head(start, [("content-type", "application/json")], len(body)), body


async def fetch(pool: Pool, key, **timeouts) -> bytes:
    connection = await pool.request(key, *post(key), **timeouts)
    try:
        parts = []
        while part := await connection.read_chunk():
            parts.append(part)
        return b"".join(parts)
    finally:
        pool.release(connection)


async def keep_alive(reader, writer, index):
    while True:
        await read_request(reader)
        writer.write(HELLO)
        await writer.drain()


async def test_keep_alive_connections_are_reused_one_request_after_another():
    async with server(keep_alive) as (key, connections):
        pool = Pool(max_connections=4)
        assert [await fetch(pool, key) for _ in range(3)] == [b"hello"] * 3
        assert connections == [0] and pool.idle_connections() == 1
        await pool.aclose()


async def test_the_request_goes_out_as_written():
    seen: list[bytes] = []

    async def handle(reader, writer, index):
        seen.append(await read_request(reader))
        writer.write(HELLO)

    async with server(handle) as (key, _):
        pool = Pool()
        await fetch(pool, key)
        await pool.aclose()
    assert seen == [
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: 1\r\n\r\nx" % key[1]
    ]


async def test_sent_is_called_once_the_request_is_written_before_the_answer_comes():
    """The server answers only once `sent` ran: had the pool waited for the head first, this
    request would hang until its read timeout."""
    called = asyncio.Event()

    async def handle(reader, writer, index):
        await read_request(reader)
        await called.wait()
        writer.write(HELLO)
        await writer.drain()

    async with server(handle) as (key, _):
        pool = Pool()
        connection = await pool.request(key, *post(key), read_timeout=60, sent=called.set)
        assert called.is_set() and await connection.read_chunk() == b"hello"
        pool.release(connection)
        await pool.aclose()


async def test_a_pooled_connection_that_went_stale_is_retried_once_on_a_fresh_one():
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(HELLO)
        await writer.drain()
        if index == 0:
            await read_request(reader)  # the second request reaches a server that closes instead
            return
        await keep_alive(reader, writer, index)

    async with server(handle) as (key, connections):
        pool = Pool()
        assert await fetch(pool, key) == b"hello"
        assert await fetch(pool, key) == b"hello"
        assert connections == [0, 1]
        await pool.aclose()


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried():
    async def handle(reader, writer, index):
        await read_request(reader)

    async with server(handle) as (key, connections):
        pool = Pool(max_connections=1)
        with pytest.raises(ProtocolError, match="no answer"):
            await fetch(pool, key)
        assert connections == [0]  # one attempt: the request may have reached the server
        assert pool.origins[key].free == 1  # the slot came back
        await pool.aclose()


async def test_the_bound_makes_a_request_wait_for_a_connection_and_then_reuse_it():
    async with server(keep_alive) as (key, connections):
        pool = Pool(max_connections=1)
        first = await pool.request(key, *post(key))
        second = asyncio.create_task(fetch(pool, key))
        await async_wait_for(lambda: len(pool.origins[key].waiters) == 1)
        assert await first.read_chunk() == b"hello" and await first.read_chunk() == b""
        pool.release(first)
        assert await second == b"hello"
        assert connections == [0] and pool.origins[key].free == 1
        await pool.aclose()


async def test_an_answer_not_read_whole_closes_its_connection_and_frees_its_slot():
    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello")  # 5 of 10 bytes, then nothing
        await reader.read()  # until the client closes

    async with server(handle) as (key, _):
        pool = Pool(max_connections=1)
        connection = await pool.request(key, *post(key))
        assert await connection.read_chunk() == b"hello"
        pool.release(connection)
        assert connection.closed and pool.idle_connections() == 0 and pool.origins[key].free == 1
        await pool.aclose()


async def test_failures_are_http1_errors_and_give_the_slot_back():
    async def silent(reader, writer, index):
        await read_request(reader)
        await reader.read()

    pool = Pool(max_connections=1)
    with refusing_port() as port:
        key = ("127.0.0.1", port, False)
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
            await pool.request(key, *post(key))
        assert pool.origins[key].free == 1
    async with server(silent) as (key, _):
        with pytest.raises(ReadTimeout):
            await pool.request(key, *post(key), read_timeout=0.2)
        assert pool.origins[key].free == 1
        await pool.aclose()


async def test_closing_the_pool_closes_every_connection_and_waits_for_their_sockets():
    ended: list[int] = []

    async def handle(reader, writer, index):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhel")
        await reader.read()  # until the client closes
        ended.append(index)

    async with server(handle) as (key, _):
        pool = Pool()
        busy = await pool.request(key, *post(key))  # an answer still being read
        await pool.aclose()
        assert busy.closed and not pool.open
        await async_wait_for(lambda: ended == [0])


def test_a_url_gives_its_origin_and_request_line():
    assert request_start("https://example.org/v1/x?a=1") == (
        ("example.org", 443, True),
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: example.org\r\n",
    )
    assert request_start("http://h:8000", "GET") == (("h", 8000, False), b"GET / HTTP/1.1\r\nhost: h:8000\r\n")
    with pytest.raises(ValueError, match="not an http"):
        request_start("ftp://h/")
