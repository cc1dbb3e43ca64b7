"""A test per uvicorn internal the seam (server.gateway.http.seam) relies on, on the installed uvicorn.

Each test names the internal it checks, so a uvicorn release that renames or changes one fails
here by name, not somewhere in a stream. They run an ASGI app under a real uvicorn server with the
gateway's own protocol class and look at what its `send` is bound to while a request is served.
"""

from __future__ import annotations

import asyncio
import re
import socket
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from server.gateway.http import seam
from server.gateway.http.seam import ConnectionLimits, GatewayHttpProtocol
from tests.support import serve_in_thread, wait_for

ROOT = Path(__file__).resolve().parents[3]


class Observer:
    """An ASGI app that records what the seam would read off uvicorn, at each step of one answer."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        cycle = getattr(send, "__self__", None)
        seen = self.seen
        seen["cycle"] = cycle
        seen["started_before"] = getattr(cycle, "response_started", None)
        seen["transport"] = getattr(cycle, "transport", None)
        seen["protocol"] = seen["transport"].get_protocol() if seen["transport"] is not None else None
        seen["counted"] = isinstance(getattr(seen["protocol"], "connections", None), set) and (
            seen["protocol"] in seen["protocol"].connections
        )
        seen["flow"] = getattr(cycle, "flow", None)
        seen["write_paused"] = getattr(seen["flow"], "write_paused", None)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        seen["started_after"] = getattr(cycle, "response_started", None)
        seen["chunked"] = getattr(cycle, "chunked_encoding", None)
        seen["complete_mid"] = getattr(cycle, "response_complete", None)
        await send({"type": "http.response.body", "body": b"hello", "more_body": True})
        if scope["path"] == "/wait":  # the client leaves while the response is open
            for _ in range(2000):
                if cycle.disconnected:
                    break
                await asyncio.sleep(0.01)
            seen["disconnected"] = cycle.disconnected
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        seen["complete_after"] = getattr(cycle, "response_complete", None)


@pytest.fixture
def observed() -> Iterator[tuple[str, Observer]]:
    app = Observer()
    protocol = ConnectionLimits(header_timeout=30, body_timeout=30, max_connections=100).protocol()
    with serve_in_thread(app, http=protocol) as url:
        yield url, app


def _get(url: str, path: str = "/") -> httpx.Response:
    return httpx.get(url + path, timeout=30)


def test_send_is_a_method_bound_to_the_request_response_cycle(observed):
    """`send.__self__`: how the seam finds the connection of a request (abort, splice, disconnect watch)."""
    url, app = observed
    assert _get(url).text == "hello"
    assert isinstance(app.seen["cycle"], RequestResponseCycle)


def test_the_cycle_holds_the_connections_transport(observed):
    """`cycle.transport`: the asyncio transport the splice writes to and `abort_connection` aborts."""
    url, app = observed
    _get(url)
    transport = app.seen["transport"]  # asyncio's or uvloop's: the methods the seam calls
    for method in ("write", "abort", "close", "is_closing", "get_protocol"):
        assert callable(getattr(transport, method, None)), method


def test_the_transport_gives_back_the_gateways_protocol(observed):
    """`transport.get_protocol()`: how `watch_disconnect` reaches the connection's protocol object."""
    url, app = observed
    _get(url)
    assert isinstance(app.seen["protocol"], GatewayHttpProtocol)
    assert isinstance(app.seen["protocol"], HttpToolsProtocol)


def test_the_cycle_has_flow_control_with_write_paused_and_drain(observed):
    """`cycle.flow`: `write_paused` (the client's buffer is full), `drain()`, `resume_reading()`."""
    url, app = observed
    _get(url)
    flow = app.seen["flow"]
    assert isinstance(flow, FlowControl)
    assert app.seen["write_paused"] is False
    assert asyncio.iscoroutinefunction(flow.drain)
    assert callable(flow.resume_reading)


def test_response_started_turns_true_with_the_head(observed):
    """`cycle.response_started`: `start_body` holds the head back only before it is True."""
    url, app = observed
    _get(url)
    assert app.seen["started_before"] is False
    assert app.seen["started_after"] is True


def test_a_head_without_length_is_chunked(observed):
    """`cycle.chunked_encoding`: the splice frames chunks itself only when uvicorn chose chunked."""
    url, app = observed
    _get(url)
    assert app.seen["chunked"] is True


def test_response_complete_turns_true_with_the_last_body(observed):
    """`cycle.response_complete`: the seam stops writing and watching once the answer is done."""
    url, app = observed
    _get(url)
    assert app.seen["complete_mid"] is False
    wait_for(lambda: app.seen.get("complete_after") is not None)
    assert app.seen["complete_after"] is True


def test_disconnected_turns_true_when_the_client_leaves(observed):
    """`cycle.disconnected`: what the writers check before writing, and the disconnect watch reads."""
    url, app = observed
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        assert b"hello" in sock.recv(65536)
    wait_for(lambda: "disconnected" in app.seen, timeout=60)
    assert app.seen["disconnected"] is True


def test_the_protocol_counts_its_servers_connections(observed):
    """`HttpToolsProtocol.connections`: the set the connection cap counts."""
    url, app = observed
    _get(url)
    assert app.seen["counted"] is True  # while its request is served


def test_every_method_the_seam_overrides_or_calls_exists():
    """The protocol's callbacks (`on_headers_complete`, ...), the cycle's and flow control's methods."""
    assert seam.uvicorn_problems() == []


def test_a_uvicorn_without_them_falls_back_to_its_own_protocol(monkeypatch, caplog):
    monkeypatch.delattr(HttpToolsProtocol, "on_message_begin")
    monkeypatch.delattr(FlowControl, "drain")
    assert seam.uvicorn_problems() == ["HttpToolsProtocol.on_message_begin", "FlowControl.drain"]

    class Limits:
        header_timeout = body_timeout = 1.0
        max_client_connections = 10

    class Settings:
        limits = Limits()

    assert seam.protocol_for(Settings()) == "httptools"
    assert "HttpToolsProtocol.on_message_begin" in caplog.text


def test_the_installed_uvicorn_is_in_the_tested_range():
    """pyproject.toml pins uvicorn to the releases these tests ran on; the installed one is one of them."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in dependencies if d.startswith("uvicorn")]
    low, high = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()  # type: ignore[union-attr]

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text)[:3])

    assert version(low) <= version(uvicorn.__version__) < version(high), (uvicorn.__version__, spec)
