"""Hostile and broken clients at the connection level: each gets an answer or a closed socket,
in the OpenAI envelope where an answer is possible, and the gateway keeps serving."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import WAIT_TIMEOUT, wait_for


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(WAIT_TIMEOUT)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _envelope(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _connect(url: str) -> socket.socket:
    parts = httpx.URL(url)
    return socket.create_connection((parts.host, parts.port), timeout=WAIT_TIMEOUT)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n",
        b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n",
    ],
    ids=["bad-content-length", "cl-and-te", "bad-chunk-size", "unknown-method", "tls-to-plain-port"],
)
def test_malformed_http_is_answered_400_in_the_envelope(engines, gateway, request_bytes):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    with _connect(gw.url) as sock:
        sock.sendall(request_bytes)
        status, body = _envelope(_read_all(sock))
    assert status == 400
    assert body["error"]["code"] == "invalid_http" and body["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=WAIT_TIMEOUT).status_code == 200


def test_silent_and_slowloris_connections_are_answered_408_and_closed(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, limits={"header_timeout": 0.3}))
    with _connect(gw.url) as silent, _connect(gw.url) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        for sock in (silent, slow):
            status, body = _envelope(_read_all(sock))
            assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=WAIT_TIMEOUT).status_code == 200


def test_a_body_that_never_finishes_closes_the_connection_and_nothing_stays_in_flight(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, limits={"body_timeout": 0.3}))
    with _connect(gw.url) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"model": '
        )
        assert _read_all(sock) == b""  # closed without an answer: nobody is listening any more
    assert engine.stats()["started"] == 0

    def in_flight() -> float:
        text = httpx.get(f"{gw.url}/metrics", timeout=WAIT_TIMEOUT).text
        lines = [line for line in text.splitlines() if line.startswith("gateway_requests_in_flight{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    wait_for(lambda: in_flight() == 0)


@pytest.mark.one_process(
    "the cap counts one process's connections: with N workers the kernel's spread decides which "
    "worker a connection meets, so cap+1 to N x cap are open before one is let go"
)
def test_a_connection_beyond_the_cap_takes_the_slot_of_the_oldest_idle_one(engines, gateway):
    """The oldest idle connection is answered 503 and closed, the newcomer served; when every
    connection is busy the newcomer is refused instead (tests/gateway/http/test_client_limits.py)."""
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, limits={"max_client_connections": 2}))
    with _connect(gw.url) as first, _connect(gw.url) as second, _connect(gw.url) as third:
        status, body = _envelope(_read_all(first))
        assert (status, body["error"]["code"]) == (503, "too_many_connections")
        for sock in (second, third):
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
