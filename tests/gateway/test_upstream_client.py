"""The gateway's HTTP transport to engines: keep-alive reuse, stale connections, limits, errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.gateway.upstream_client import UpstreamTransport
from tests.support import free_port, serve_in_thread


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
        await asyncio.sleep(1.5)  # past the server's keep-alive timeout: it closes the idle connection
        assert (await client.get(f"{server_url}/")).text == "hello"


async def test_max_connections_bounds_concurrent_requests(server_url):
    transport = UpstreamTransport(max_connections=2)
    async with httpx.AsyncClient(transport=transport, timeout=10) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(*(client.get(f"{server_url}/slow") for _ in range(4)))
        assert loop.time() - started >= 0.55  # two rounds of 0.3 s, not one
        assert transport.idle_connections() == 2


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
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/")
