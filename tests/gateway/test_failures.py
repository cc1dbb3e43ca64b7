"""Engines that refuse, fail, die mid-stream or are slow: what the client sees, against real servers."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import refusing_port, wait_for

# Far beyond what any request here takes, even on a busy machine: a bound that only a hang breaks.
HANG = 30.0


@pytest.mark.one_process("sets and reads an engine's health inside the gateway")
def test_connection_refused_fails_over_and_marks_the_engine_down(engines, gateway):
    (live,) = engines(1)
    with refusing_port() as port:  # held for the whole test: no other process can serve it meanwhile
        dead = f"http://127.0.0.1:{port}"
        # Round robin gives the dead replica its turn whatever a smarter policy would prefer.
        gw = gateway(
            fast_settings({"standin": [dead, live.url]}, health={"interval": 60}, routing={"policy": "round_robin"})
        )
        dead_engine = gw.engine("standin", 0)
        dead_engine.healthy = True  # as if the first health check had passed before it died
        for _ in range(4):
            response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
            assert response.status_code == 200, response.text
        assert live.stats()["finished"] == 4
        assert not dead_engine.healthy  # passively ejected on the first refused connection


def test_503_before_the_first_byte_goes_to_another_replica(engines, gateway):
    busy, idle = engines(2)
    busy.faults(status=503)
    gw = gateway(fast_settings({"standin": [busy.url, idle.url]}))
    for stream in (False, True):
        for _ in range(3):
            response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=stream), timeout=10)
            assert response.status_code == 200
            if stream:
                assert sse_events(response.text)[-1] == "[DONE]"
    assert idle.stats()["finished"] == 6
    assert busy.stats()["finished"] == 0


def test_503_from_every_replica_reaches_the_client_as_the_engine_sent_it(engines, gateway):
    a, b = engines(2)
    for engine in (a, b):
        engine.faults(status=503)
    gw = gateway(fast_settings({"standin": [a.url, b.url]}, retries={"max_attempts": 3}))
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
    assert response.status_code == 503
    assert "error" in response.json()  # the engine's own envelope
    assert a.stats()["rejected"] + b.stats()["rejected"] == 2  # each replica tried once, no more


def test_engine_dying_mid_stream_ends_the_stream_with_an_error_event_and_done(engines, gateway):
    (engine,) = engines(1)
    # No gateway timeout could end a stream the gateway failed to notice was cut: the client's would.
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"idle": 4 * HANG, "total": 4 * HANG}))
    body = chat_body(stream=True, standin={"die_after_chunks": 3})
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=HANG)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert len(events) == 5  # 3 relayed, then the error, then [DONE]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_failed" and error["type"] == "upstream_error"
    assert events[-1] == "[DONE]"


def test_engine_dying_before_the_first_chunk_is_retried(engines, gateway):
    flaky, good = engines(2)
    flaky.faults(die_after_chunks=0)
    gw = gateway(fast_settings({"standin": [flaky.url, good.url]}, routing={"policy": "round_robin"}))
    for _ in range(4):
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=10)
        assert response.status_code == 200
        assert sse_events(response.text)[-1] == "[DONE]"
        assert "error" not in response.text
    assert good.stats()["finished"] == 4


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A loopback port whose accept queue is full: new connections hang in SYN until they time out."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.settimeout(0.2)
            with contextlib.suppress(OSError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@pytest.mark.one_process("sets an engine's health inside the gateway")
def test_connect_timeout_answers_504(gateway):
    with black_hole() as port:
        gw = gateway(
            fast_settings({"standin": [f"http://127.0.0.1:{port}"]}, timeouts={"connect": 0.2}, health={"interval": 60})
        )
        gw.engine("standin").healthy = True
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=HANG)
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout" and "connection" in error["message"]


def test_first_byte_timeout_answers_504_and_aborts_the_engine_request(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"first_byte": 0.3}))
    for stream in (True, False):
        started = time.perf_counter()
        response = httpx.post(
            f"{gw.url}/v1/chat/completions",
            timeout=HANG,
            json=chat_body(stream=stream, standin={"first_byte_delay_s": 4 * HANG}),
        )
        took = time.perf_counter() - started
        assert response.status_code == 504, response.text
        assert took > 0.25  # not before the timeout; the engine's first byte would have come after 4 * HANG
        error = response.json()["error"]
        assert error["code"] == "upstream_timeout" and "first byte" in error["message"]
    # Aborted, not left to run: without the abort the engine would hold both for 4 * HANG.
    wait_for(lambda: engine.stats()["running"] == 0, what=engine.stats)
    stats = engine.stats()
    assert stats["aborted"] == 2 and stats["finished"] == 0


def test_idle_timeout_ends_a_stalled_stream_with_an_error_event(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"idle": 0.3}))
    body = chat_body(stream=True, standin={"stall_after_chunks": 2, "stall_s": 4 * HANG})
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=HANG)  # the stall would outlast it
    events = sse_events(response.text)
    assert len(events) == 4
    error = json.loads(events[2])["error"]
    assert error["code"] == "upstream_timeout" and "idle" in error["message"]
    assert events[3] == "[DONE]"


def test_total_timeout_bounds_streaming_and_non_streaming_requests(engines, gateway):
    (engine,) = engines(1, ttft_ms=10, itl_ms=50, tokens=1200)  # 60 s of generation, a chunk every 50 ms
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts={"total": 1.0}))
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True), timeout=HANG)
    events = sse_events(response.text)
    # Some chunks relayed, then cut after about 1 s: 100 chunks would be 5 s, the full answer 1202.
    assert 3 <= len(events) < 100
    assert "total" in json.loads(events[-2])["error"]["message"]
    assert events[-1] == "[DONE]"

    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=HANG)
    assert response.status_code == 504
    assert "total" in response.json()["error"]["message"]


def test_engine_error_status_and_body_pass_through(engines, gateway):
    (engine,) = engines(1, max_model_len=64)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    body = chat_body("word " * 100, max_tokens=8)
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=10)
    via = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    assert direct.status_code == via.status_code == 400
    assert via.json() == direct.json()
