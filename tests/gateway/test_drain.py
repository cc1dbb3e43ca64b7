"""Drain: SIGTERM, a real signal to a real gateway process, while 20 streams are in flight.

The gateway (`python -m server serve`) stands in front of a stand-in engine that holds every
request until released, so all 20 streams are provably in flight when the signal arrives. Then:
the listening socket closes (new connections are refused, so no new request is accepted), the
held streams are released and every one completes, the engine saw exactly the 20 requests, and
the process exits 0 on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx

from tests.gateway.conftest import chat_body, sse_events
from tests.support import free_port, refuses_connections, wait_for

STREAMS = 20
TOKENS = 12


def closed_for_good(url: str) -> bool:
    """The listener is gone: a connection in its backlog closed unanswered does not count yet."""
    return refuses_connections(url, "/ready", unanswered=False)


def test_sigterm_during_20_streams_finishes_every_stream_and_accepts_nothing_new(engines, tmp_path):
    (engine,) = engines(1, ttft_ms=2, itl_ms=5, tokens=TOKENS)
    engine.faults(hold=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "gateway.log").open("w")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--upstream", f"standin={engine.url}", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "GATEWAY_API_KEYS"},  # an open gateway
    )
    results: list[str] = []
    try:

        def up() -> bool:
            if gateway.poll() is not None:
                log.flush()
                raise AssertionError((tmp_path / "gateway.log").read_text()[-3000:])
            return not closed_for_good(url) and httpx.get(f"{url}/ready", timeout=5).status_code == 200

        wait_for(up, timeout=60, interval=0.1, what="the gateway to be ready")

        def stream(i: int) -> None:
            try:
                body = chat_body(f"stream {i}", stream=True)
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                    text = "".join(response.iter_text())
                events = sse_events(text)
                ok = (
                    response.status_code == 200
                    and events[-1:] == ["[DONE]"]
                    and not any('"error"' in event for event in events)
                    and len(events) == 1 + TOKENS + 1
                )
                results.append("ok" if ok else f"{response.status_code}: {text[-300:]}")
            except httpx.HTTPError as exc:
                results.append(f"{type(exc).__name__}: {exc}")

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for client in clients:
            client.start()
        wait_for(lambda: engine.stats()["held"] == STREAMS, timeout=60, what=engine.stats)

        gateway.send_signal(signal.SIGTERM)
        wait_for(lambda: closed_for_good(url), timeout=60, what="the listening socket to close")
        assert gateway.poll() is None  # still running: it drains
        for _ in range(3):  # new requests find no listener
            try:
                httpx.post(f"{url}/v1/chat/completions", json=chat_body(), timeout=5)
                raise AssertionError("a request was accepted after SIGTERM")
            except httpx.ConnectError:
                pass

        httpx.post(f"{engine.url}/_standin/release", timeout=5).raise_for_status()
        for client in clients:
            client.join(120)
        assert results == ["ok"] * STREAMS, [r for r in results if r != "ok"][:3]
        assert gateway.wait(timeout=120) == 0
        stats = engine.stats()
        assert stats["started"] == STREAMS and stats["finished"] == STREAMS
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(timeout=30)
        log.close()
    assert "shutting down" in (tmp_path / "gateway.log").read_text()
