"""http1.Connection.splice: each chunk to the sink as it is parsed, a flush per read, flow control.

Bytes fed directly (see test_framing), so each `data_received` is exactly one read.
"""

from __future__ import annotations

import asyncio

import pytest

from http1 import ProtocolError
from tests.http1.test_framing import REQUEST, connected
from tests.support import async_wait_for

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


async def started(splice) -> asyncio.Task:
    """The splice as a task that has run up to its first wait (its sink is in place)."""
    task = asyncio.ensure_future(splice)
    await asyncio.sleep(0)  # one turn of the loop: the task runs first, up to its first await
    return task


async def test_chunks_reach_the_sink_in_order_with_one_flush_per_read_but_not_after_the_last():
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(HEAD + b"3\r\nhel\r\n")  # before the splice: buffered
    await connection.read_head()
    got: list[bytes] = []
    flushed: list[int] = []

    def flush() -> bool:
        flushed.append(len(got))
        return False

    async def drain() -> None:
        raise AssertionError("never full")

    task = await started(connection.splice(got.append, flush, drain))
    assert got == [b"hel"] and flushed == [1]  # what was buffered goes first, flushed at once
    connection.data_received(b"1\r\nl\r\n1\r\no\r\n")  # two chunks, one read: one flush
    assert got == [b"hel", b"l", b"o"] and flushed == [1, 3]
    connection.data_received(b"1\r\n!\r\n0\r\n\r\n")  # the last chunk and the end in one read
    await task
    assert got == [b"hel", b"l", b"o", b"!"] and flushed == [1, 3]  # the caller sends that one
    assert connection.reusable() and connection.sink is None


async def test_a_full_consumer_pauses_reading_until_it_drained():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(HEAD)
    await connection.read_head()
    got: list[bytes] = []
    drained = asyncio.Event()
    seen_paused: list[bool] = []

    async def drain() -> None:
        seen_paused.append(not transport.reading)
        await drained.wait()

    task = await started(connection.splice(got.append, lambda: True, drain))
    connection.data_received(b"3\r\nhel\r\n")
    assert not transport.reading  # the consumer is full: the socket is not read
    await async_wait_for(lambda: seen_paused)
    assert seen_paused == [True] and not task.done()
    drained.set()
    await async_wait_for(lambda: transport.reading)  # drained: reading again
    connection.data_received(b"2\r\nlo\r\n0\r\n\r\n")
    await task
    assert b"".join(got) == b"hello"


async def test_without_a_flush_reading_never_pauses():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(HEAD)
    await connection.read_head()
    got: list[bytes] = []
    task = await started(connection.splice(got.append))
    connection.data_received(b"3\r\nhel\r\n")
    connection.data_received(b"2\r\nlo\r\n0\r\n\r\n")
    await task
    assert got == [b"hel", b"lo"] and transport.reading


@pytest.mark.parametrize("where", ["sink", "flush"])
async def test_a_failing_sink_or_flush_fails_the_splice_and_closes_the_connection(where):
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(HEAD)
    await connection.read_head()

    def sink(chunk: bytes) -> None:
        if where == "sink":
            raise ValueError("the consumer's own bug")

    def flush() -> bool:
        if where == "flush":
            raise ValueError("the consumer's own bug")
        return False

    async def drain() -> None:
        pass

    task = await started(connection.splice(sink, flush, drain))
    connection.data_received(b"3\r\nhel\r\n")
    with pytest.raises(ValueError, match="own bug"):
        await task
    assert transport.closing and not connection.reusable() and connection.sink is None


async def test_a_body_cut_mid_splice_fails_it():
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(HEAD)
    await connection.read_head()
    got: list[bytes] = []
    task = await started(connection.splice(got.append))
    connection.data_received(b"3\r\nhel\r\n")
    connection.connection_lost(None)
    with pytest.raises(ProtocolError, match="broke off"):
        await task
    assert got == [b"hel"]
