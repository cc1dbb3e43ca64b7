"""The gateway's HTTP transport to engines: keep-alive reuse, stale connections, limits, errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.gateway.proxy.transport import UpstreamTransport
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


def test_an_injected_httpx_client_carries_the_proxied_traffic(gateway):
    from tests.gateway.conftest import chat_body, fast_settings, sse_events
    from tests.standin import StandinConfig, build_app

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
