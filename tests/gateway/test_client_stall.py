"""A stream cut because the client stopped reading is the client's stall, not the engine's idle timeout."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import WAIT_TIMEOUT, wait_for


class AccessLog:
    """The access-log records a gateway writes (create_app's `log_request`)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, **fields) -> None:
        with self._lock:
            self.records.append(fields)

    def find(self, **match) -> dict | None:
        with self._lock:
            return next((r for r in self.records if all(r.get(k) == v for k, v in match.items())), None)


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=WAIT_TIMEOUT).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("gateway_requests_in_flight{")
    )


def _stalling_client(url: str, body: dict) -> socket.socket:
    """A client with a tiny receive buffer that sends `body`, reads the response head, then stops reading."""
    parts = httpx.URL(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.settimeout(WAIT_TIMEOUT)
    sock.connect((parts.host, parts.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.one_process("hands the gateway a Python callback for its request reports")
def test_a_client_that_stops_reading_is_cut_as_client_stalled_not_as_an_idle_engine(engines, gateway):
    # About 20 MB of stream, produced as fast as the stand-in can: far more than the buffers on the way
    # hold (socket buffers, the gateway's write buffer and its 1 MiB of unread engine bytes). The idle
    # timeout is long enough that a busy machine pausing the stand-in does not trigger it first.
    (engine,) = engines(1, ttft_ms=1, itl_ms=0, tokens=100_000)
    log = AccessLog()
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"idle": 2.0}), log_request=log)
    with _stalling_client(gw.url, chat_body(stream=True)) as sock:
        record = wait_for(lambda: log.find(model="standin"))
        assert record["status"] == 499
        assert record["error"].startswith("client_stalled") and "idle timeout of 2 s" in record["error"]
        # The connection is closed at once (not after the unsent bytes drain): reading ends.
        received = 0
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 100_000 * 150  # cut well before the end of the stream
    wait_for(lambda: in_flight(gw.url) == 0)
    answer = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=WAIT_TIMEOUT)
    assert answer.status_code == 200


@pytest.mark.one_process("hands the gateway a Python callback for its request reports")
def test_an_engine_that_stops_sending_to_a_reading_client_is_the_engines_idle_timeout(engines, gateway):
    (engine,) = engines(1)
    log = AccessLog()
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"idle": 0.3}), log_request=log)
    body = chat_body(stream=True, standin={"stall_after_chunks": 2, "stall_s": 4 * WAIT_TIMEOUT})
    events = sse_events(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=WAIT_TIMEOUT).text)
    assert json.loads(events[-2])["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    record = wait_for(lambda: log.find(model="standin"))
    assert record["status"] == 200 and "idle timeout" in record["error"]
    assert "client_stalled" not in record["error"]
    wait_for(lambda: in_flight(gw.url) == 0)
