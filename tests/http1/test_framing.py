"""http1.Connection's framing, fed bytes directly: sized, chunked and close-delimited bodies, bad ones.

No sockets here: each test hands the protocol the reads a server would cause (`data_received`)
and the close (`connection_lost`), so every split of the bytes is exactly the one written.
"""

from __future__ import annotations

import asyncio

import pytest

from http1 import PAUSE_ABOVE, Connection, ProtocolError, ends_at_close

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\ncontent-length: 1\r\n\r\n"


class FakeTransport(asyncio.Transport):
    """What of a transport the connection uses: writes kept, reading paused or not, closed or not."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.reading = True
        self.closing = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


def connected(**options) -> tuple[Connection, FakeTransport]:
    connection = Connection(asyncio.get_running_loop(), **options)
    transport = FakeTransport()
    connection.connection_made(transport)
    return connection, transport


async def body_of(connection: Connection) -> bytes:
    await connection.read_head()
    parts = []
    while part := await connection.read_chunk():
        parts.append(part)
    return b"".join(parts)


async def test_a_sized_body_is_read_whole_and_leaves_the_connection_reusable():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    assert transport.written == [REQUEST + b"x"]  # head and body in one write
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhel")
    connection.data_received(b"lo")
    assert await body_of(connection) == b"hello"
    assert connection.status == 200
    assert connection.headers == [(b"content-type", b"text/plain"), (b"content-length", b"5")]
    assert connection.reusable()


async def test_a_large_request_body_is_written_after_its_head_not_copied_into_it():
    connection, transport = connected()
    body = b"x" * 100_000
    connection.send(REQUEST, body)
    assert transport.written == [REQUEST, body]


async def test_chunk_extensions_are_skipped_and_trailers_are_not_headers():
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3;name=value\r\nhel\r\n2;flag\r\nlo\r\n0\r\nx-trailer: late\r\n\r\n"
    )
    assert await body_of(connection) == b"hello"
    assert connection.headers == [(b"transfer-encoding", b"chunked")]
    assert connection.reusable()


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"],
    ids=["http/1.0", "http/1.1 closing"],
)
async def test_a_body_with_neither_length_nor_chunks_ends_where_the_server_closes(head):
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(head + b"hel")
    connection.data_received(b"lo")
    assert not connection.body_done  # nothing says the body ended yet
    connection.connection_lost(None)
    assert await body_of(connection) == b"hello"
    assert not connection.reusable()  # closed: not kept for another request


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello",
        b"HTTP/1.0 200 OK\r\n\r\nhel",  # close-delimited, but the connection was reset, not closed
    ],
    ids=["chunked", "sized", "reset"],
)
async def test_a_body_cut_by_the_close_fails(answer):
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(answer)
    await connection.read_head()
    reset = ConnectionResetError("reset by peer") if answer.startswith(b"HTTP/1.0") else None
    connection.connection_lost(reset)
    assert await connection.read_chunk() != b""  # what came before the close is still there
    with pytest.raises(ProtocolError, match="broke off"):
        await connection.read_chunk()
    assert not connection.reusable()


async def test_a_close_before_the_head_is_no_answer():
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-")
    connection.connection_lost(None)
    with pytest.raises(ProtocolError, match="no answer"):
        await connection.read_head()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhel\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"f" * 20 + b"\r\n", "overflow"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n", "Content-Length"),
        (b"HTTX/1.1 200 OK\r\n\r\n", "HTTP/"),
    ],
    ids=["bad chunk size", "chunk size overflow", "bad length", "length and chunks", "not http"],
)
async def test_invalid_framing_fails_the_answer_and_closes_the_connection(answer, reason):
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(answer)
    with pytest.raises(ProtocolError, match=reason):
        await body_of(connection)
    assert transport.closing and not connection.reusable()


async def test_a_head_over_its_limit_fails():
    connection, transport = connected(max_head_bytes=1000)
    connection.send(REQUEST, b"x")
    connection.data_received(b"HTTP/1.1 200 OK\r\nx-small: 1\r\n")
    connection.data_received(b"x-big: " + b"v" * 1000 + b"\r\ncontent-length: 0\r\n\r\n")
    with pytest.raises(ProtocolError, match="over 1000 bytes"):
        await connection.read_head()
    assert transport.closing


async def test_one_request_at_a_time_and_an_answer_nobody_asked_for_ends_the_connection():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    with pytest.raises(RuntimeError, match="no pipelining"):
        connection.send(REQUEST, b"y")  # the first answer has not ended
    assert transport.written == [REQUEST + b"x"]
    one = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    connection.data_received(one + one)  # two answers to one request
    assert await body_of(connection) == b"hello"  # the first is whole
    assert transport.closing and not connection.reusable()  # but the connection is not trusted again
    with pytest.raises(ProtocolError, match="closed"):
        connection.send(REQUEST, b"z")


async def test_the_next_request_starts_a_fresh_answer():
    connection, _ = connected()
    for body in (b"first", b"second"):
        connection.send(REQUEST, b"x")
        connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert await body_of(connection) == body
        assert connection.reusable()


async def test_each_read_is_stamped_on_arrival_and_its_chunks_carry_that_stamp():
    reads = iter(range(1, 100))
    connection, _ = connected(clock=lambda: float(next(reads)))
    connection.send(REQUEST, b"x")
    connection.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n")
    connection.data_received(b"1\r\nl\r\n1\r\no\r\n")  # two chunks in one read
    connection.data_received(b"0\r\n\r\n")
    await connection.read_head()
    assert connection.arrived == 3.0  # the last read's stamp
    chunks = [chunk async for chunk in _chunks(connection)]
    assert chunks == [(b"hel", 1.0), (b"l", 2.0), (b"o", 2.0)]


async def _chunks(connection: Connection):
    while (chunk := await connection.next_chunk()) is not None:
        yield chunk


async def test_without_a_clock_chunks_carry_no_stamp():
    connection, _ = connected()
    connection.send(REQUEST, b"x")
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi")
    assert await connection.next_chunk() == (b"hi", 0.0)
    assert await connection.next_chunk() is None


async def test_a_buffered_body_not_taken_pauses_reading_until_it_is():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    size = 3 * PAUSE_ABOVE
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
    connection.data_received(b"a" * (PAUSE_ABOVE + 1))
    assert not transport.reading
    assert len(await connection.read_chunk()) == PAUSE_ABOVE + 1
    assert transport.reading
    connection.data_received(b"b" * (size - PAUSE_ABOVE - 1))
    assert len(await connection.read_chunk()) == size - PAUSE_ABOVE - 1
    assert await connection.read_chunk() == b""
    assert connection.reusable()


async def test_an_answer_that_ended_while_reading_was_paused_does_not_leave_the_next_one_paused():
    connection, transport = connected()
    connection.send(REQUEST, b"x")
    size = PAUSE_ABOVE + 10
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"a" * size)
    assert connection.body_done and not transport.reading  # whole, but its reader was behind
    connection.send(REQUEST, b"y")  # the reader dropped it: the next request reads again
    assert transport.reading


def test_what_counts_as_a_body_that_ends_at_the_close():
    assert ends_at_close([(b"Content-Type", b"text/plain")])
    assert ends_at_close([(b"Transfer-Encoding", b"gzip")])  # chunked is not the last coding
    assert not ends_at_close([(b"Content-Length", b"0")])
    assert not ends_at_close([(b"Transfer-Encoding", b"gzip, chunked")])
