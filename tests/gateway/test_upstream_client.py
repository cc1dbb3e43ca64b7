"""The gateway's HTTP transport to engines: keep-alive reuse, stale connections, limits, errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.gateway.proxy.transport import UpstreamTransport, _Origin
from tests.support import async_wait_for, refusing_port, serve_in_thread


async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for part in (b"hel", b"lo"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
        if scope["path"] == "/slow-body":
            await asyncio.sleep(0.3)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def server_url():
    with serve_in_thread(hello, timeout_keep_alive=1) as url:
        yield url


async def test_connections_are_reused_and_bodies_stream(server_url):
    transport = UpstreamTransport(max_connections=4)
    async with httpx.AsyncClient(transport=transport) as client:
        for _ in range(5):
            async with client.stream("POST", f"{server_url}/", content=b"x") as response:
                assert b"".join([part async for part in response.aiter_raw()]) == b"hello"
                assert response.status_code == 200
            assert transport.idle_connections() == 1
        responses = await asyncio.gather(*(client.get(f"{server_url}/") for _ in range(3)))
        assert [r.text for r in responses] == ["hello"] * 3
        assert transport.idle_connections() == 3


async def test_a_connection_the_server_closed_while_idle_is_replaced(server_url):
    transport = UpstreamTransport(max_connections=2)
    async with httpx.AsyncClient(transport=transport) as client:
        assert (await client.get(f"{server_url}/")).text == "hello"
        (idle,) = [connection for origin in transport._origins.values() for connection in origin.idle]
        await async_wait_for(lambda: idle.closed)  # the server's keep-alive timeout (1 s) closed it
        assert (await client.get(f"{server_url}/")).text == "hello"


async def test_max_connections_bounds_concurrent_requests(server_url):
    transport = UpstreamTransport(max_connections=2)
    async with httpx.AsyncClient(transport=transport, timeout=10) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*(client.get(f"{server_url}/slow") for _ in range(4)))
        assert loop.time() - started >= 0.55  # two rounds of 0.3 s, not one
        assert transport.idle_connections() == 2


async def test_the_connection_bound_serves_waiters_in_order_and_survives_cancellation():
    origin = _Origin(1)
    origin.free -= 1  # one request holds the only slot
    served: list[str] = []

    async def request(name: str) -> None:
        await origin.wait_for_slot()
        served.append(name)

    first, gone, last = (asyncio.create_task(request(n)) for n in ("first", "gone", "last"))
    await async_wait_for(lambda: len(origin.waiters) == 3)
    gone.cancel()  # a waiter that leaves before its turn takes nothing with it
    await asyncio.gather(gone, return_exceptions=True)
    assert len(origin.waiters) == 2
    origin.release()
    await first
    assert served == ["first"] and origin.free == 0  # handed over, not counted free
    origin.release()
    last.cancel()  # handed a slot as it was cancelled: the slot goes back, not lost
    await asyncio.gather(last, return_exceptions=True)
    assert served == ["first"] and origin.free == 1 and not origin.waiters


async def test_a_waiter_cancelled_and_then_passed_over_by_a_release_leaves_cleanly():
    origin = _Origin(1)
    origin.free -= 1
    waiting = asyncio.create_task(origin.wait_for_slot())
    await async_wait_for(lambda: len(origin.waiters) == 1)
    waiting.cancel()  # its waiter is cancelled at once...
    origin.release()  # ...and a release before it runs again drops it and counts the slot free
    with pytest.raises(asyncio.CancelledError):  # (not a ValueError from the queue)
        await waiting
    assert origin.free == 1 and not origin.waiters


async def test_unfinished_responses_close_their_connection(server_url):
    transport = UpstreamTransport(max_connections=2)
    async with httpx.AsyncClient(transport=transport) as client:
        async with client.stream("GET", f"{server_url}/slow-body") as response:
            assert await response.aiter_raw().__anext__() == b"hel"
        assert transport.idle_connections() == 0
        assert (await client.get(f"{server_url}/")).text == "hello"


async def test_errors_are_httpx_errors():
    transport = UpstreamTransport()
    async with httpx.AsyncClient(transport=transport, timeout=2) as client:
        with refusing_port() as port, pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/")


@pytest.mark.one_process("hands the gateway an httpx client object")
def test_an_injected_httpx_client_carries_the_proxied_traffic(gateway):
    from standin import StandinConfig, build_app
    from tests.gateway.conftest import chat_body, fast_settings, sse_events

    engine = build_app(StandinConfig(ttft_ms=1, itl_ms=1, tokens=3))
    with serve_in_thread(engine) as engine_url:
        sent = []
        client = httpx.AsyncClient(
            limits=httpx.Limits(max_keepalive_connections=0),  # nothing left open
            event_hooks={"request": [lambda request: _record(sent, request)]},
        )
        gw = gateway(fast_settings({"standin": [engine_url]}), http_client=client)
        streamed = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=10)
        plain = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
    assert sse_events(streamed.text)[-1] == "[DONE]" and plain.json()["choices"]
    assert [r.url.path for r in sent] == ["/v1/chat/completions"] * 2


async def _record(sent, request):
    sent.append(request)


async def _splice(response, *, full_after: int | None = None):
    """Splice `response` into a list; its flush says "full" from chunk `full_after` on."""
    got: list[bytes] = []
    flushed: list[int] = []
    drains = []

    def flush() -> bool:
        flushed.append(len(got))
        return full_after is not None and len(got) >= full_after

    async def drain() -> None:
        drains.append(len(got))
        assert response._connection.paused  # the engine's socket is not read while the client is full

    await response.splice(got.append, flush, drain)
    return got, drains


async def test_a_spliced_body_reaches_the_sink_in_order_and_the_connection_is_reused(server_url):
    transport = UpstreamTransport(max_connections=2)
    target = transport.target(f"{server_url}/slow-body")
    response = await transport.post(target, [], b"x")
    assert await response.read_chunk() == b"hel"  # the proxy reads the first chunk itself, then splices
    got, drains = await _splice(response)
    await response.aclose()
    assert (got, drains) == ([b"lo"], [])
    assert transport.idle_connections() == 1
    await transport.aclose()


async def test_a_full_sink_pauses_the_engine_socket_until_it_drains(server_url):
    transport = UpstreamTransport(max_connections=2)
    response = await transport.post(transport.target(f"{server_url}/slow-body"), [], b"x")
    got, drains = await _splice(response, full_after=1)
    await response.aclose()
    assert b"".join(got) == b"hello"
    assert drains and not response._connection.paused  # drained, then reading resumed
    assert transport.idle_connections() == 1  # the whole body was read: reusable
    await transport.aclose()


async def test_a_failing_sink_fails_the_splice_and_closes_the_connection(server_url):
    transport = UpstreamTransport(max_connections=2)
    response = await transport.post(transport.target(f"{server_url}/slow-body"), [], b"x")
    await response.read_chunk()

    def sink(chunk: bytes) -> None:
        raise ValueError("the relay's own bug")

    async def drain() -> None:
        raise AssertionError("not full")

    with pytest.raises(ValueError, match="own bug"):
        await response.splice(sink, lambda: False, drain)
    await response.aclose()
    assert transport.idle_connections() == 0
    await transport.aclose()


async def test_an_engine_that_dies_mid_body_fails_the_splice_with_an_httpx_error():
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(1)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = UpstreamTransport()
    response = await transport.post(transport.target(f"http://127.0.0.1:{port}/"), [], b"x")
    got: list[bytes] = []

    async def drain() -> None:
        pass

    with pytest.raises(httpx.RemoteProtocolError):
        await response.splice(got.append, lambda: False, drain)
    assert got == [b"hel"]
    await response.aclose()
    server.close()
    await server.wait_closed()


async def test_what_the_read_that_ends_the_body_gave_is_left_to_the_caller_not_flushed():
    # Each write of the engine waits for the relay to have taken the one before, so every write is
    # one read however busy the machine.
    hel_read, l_flushed = asyncio.Event(), asyncio.Event()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(1)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n")
        await hel_read.wait()
        writer.write(b"1\r\nl\r\n")
        await l_flushed.wait()
        writer.write(b"1\r\no\r\n0\r\n\r\n")  # the last chunk and the end in one read
        await writer.drain()
        await reader.read()  # until the client closes the connection
        writer.close()
        done.set_result(None)

    done = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = UpstreamTransport()
    response = await transport.post(transport.target(f"http://127.0.0.1:{port}/"), [], b"x")
    assert await response.read_chunk() == b"hel"
    hel_read.set()
    got: list[bytes] = []
    flushed: list[int] = []

    def flush() -> bool:
        flushed.append(len(got))
        l_flushed.set()
        return False

    async def drain() -> None:
        pass

    await response.splice(got.append, flush, drain)
    # Flushed after the read that brought "l"; not after the one that brought "o" and the body's end:
    # what that read brought is the caller's to send with the end of its own answer.
    assert got == [b"l", b"o"] and flushed == [1]
    await response.aclose()
    await transport.aclose()
    await done
    server.close()
    await server.wait_closed()


async def test_under_another_asgi_server_the_body_goes_through_its_send():
    from server.gateway.http.seam import SendWriter, body_writer

    messages = []

    async def send(message):
        messages.append(message)

    writer = body_writer(send)
    assert isinstance(writer, SendWriter)
    assert not writer.flush()
    writer.write(b"a")
    writer.write(b"b")
    assert writer.flush()  # something written asks for a drain
    await writer.drain()
    await writer.drain()  # nothing pending: nothing sent
    writer.write(b"c")
    assert writer.release() == b"c"  # what a deadline's error event must follow
    assert messages == [{"type": "http.response.body", "body": b"ab", "more_body": True}]


def test_chunks_written_together_leave_in_one_write_framed_as_one_http_chunk():
    from types import SimpleNamespace

    from server.gateway.http.seam import ChunkedWriter

    writes: list[bytes] = []
    flow = SimpleNamespace(write_paused=False)
    cycle = SimpleNamespace(disconnected=False, flow=flow, transport=SimpleNamespace(write=writes.append))
    writer = ChunkedWriter(cycle)
    assert not writer.flush()  # nothing written: no system call
    writer.write(b"data: 1\n\n")
    writer.write(b"data: 22\n\n")
    flow.write_paused = True  # the client's buffer went over its high-water mark
    assert writer.flush()
    assert writes == [b"13\r\ndata: 1\n\ndata: 22\n\n\r\n"]
    cycle.disconnected = True
    writer.write(b"x")
    assert not writer.flush() and len(writes) == 1  # a client that left is written nothing


async def test_the_response_head_leaves_with_the_first_chunk_and_the_last_chunks_with_the_end():
    from types import SimpleNamespace

    from server.gateway.http.seam import ChunkedWriter, start_body

    writes: list[bytes] = []
    transport = SimpleNamespace(write=writes.append)

    class Cycle:  # what of uvicorn's RequestResponseCycle the writer uses
        disconnected = response_started = response_complete = False
        chunked_encoding = None
        flow = SimpleNamespace(write_paused=False)

        def __init__(self) -> None:
            self.transport = transport

        async def send(self, message):  # uvicorn writes a response head to its transport
            self.response_started = self.chunked_encoding = True
            self.transport.write(b"HTTP/1.1 200 OK\r\n\r\n")

    cycle = Cycle()
    writer = await start_body(cycle.send, {"type": "http.response.start", "status": 200, "headers": []})
    assert isinstance(writer, ChunkedWriter) and cycle.transport is transport and writes == []
    writer.write(b"data: 1\n\n")
    writer.flush()
    assert writes == [b"HTTP/1.1 200 OK\r\n\r\n9\r\ndata: 1\n\n\r\n"]  # one system call
    writer.write(b"data: [DONE]\n\n")
    assert writer.release() == b"data: [DONE]\n\n" and len(writes) == 1  # for `send`, with the last chunk


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello", b"HTTP/1.0 200 OK\r\n\r\nhello"],
    ids=["http/1.1 closing", "http/1.0"],
)
async def test_a_body_without_a_length_ends_where_the_connection_does(answer):
    """An answer with neither content-length nor chunks is complete when the engine closes; a chunked
    one cut short by the close is still a failure."""

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            answer
            if (await reader.readexactly(1)) == b"x"
            else b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    transport = UpstreamTransport(max_connections=2)
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post(url, content=b"x")
        assert (response.status_code, response.content) == (200, b"hello")
        assert transport.idle_connections() == 0  # closed: not kept for another request
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(url, content=b"y")
    server.close()
    await server.wait_closed()
