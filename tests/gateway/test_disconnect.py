"""A client that leaves makes the engine stop generating, within a second, streaming or not."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings

SLOW = {"ttft_ms": 50, "itl_ms": 50, "tokens": 60}  # 3 s of generation


def wait_until_aborted(engine, left_at: float, limit: float = 1.0) -> float:
    """Seconds from the client leaving until the engine saw its request aborted."""
    while time.perf_counter() - left_at < limit + 1.0:
        stats = engine.stats()
        if stats["running"] == 0 and stats["aborted"] >= 1:
            return time.perf_counter() - left_at
        time.sleep(0.01)
    raise AssertionError(f"engine still busy {limit + 1.0:.1f} s after the client left: {engine.stats()}")


def test_streaming_client_leaving_mid_stream_aborts_the_engine_request(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True)) as response:
            chunks = response.iter_raw()
            assert next(chunks).startswith(b"data: ")
            assert engine.stats()["running"] == 1
        left_at = time.perf_counter()  # closing an unfinished response closes the connection
    assert wait_until_aborted(engine, left_at) < 1.0
    assert engine.stats()["finished"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_first_byte_aborts_the_engine_request(engines, gateway, stream):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    body = chat_body(stream=stream, standin={"first_byte_delay_s": 5})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    left_at = time.perf_counter()
    assert wait_until_aborted(engine, left_at) < 1.0


def test_non_streaming_client_leaving_aborts_the_engine_request(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    with pytest.raises(httpx.ReadTimeout):  # the answer would take 3 s; the client gives up after 0.5 s
        httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=httpx.Timeout(10, read=0.5))
    left_at = time.perf_counter()
    assert engine.stats()["started"] == 1
    assert wait_until_aborted(engine, left_at) < 1.0
    assert engine.stats()["finished"] == 0


def test_after_a_disconnect_the_engine_slot_and_connection_pool_recover(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=httpx.Timeout(10, read=0.2))
    wait_until_aborted(engine, time.perf_counter())
    assert gw.engine("standin").outstanding == 0
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(standin={"tokens": 2, "itl_ms": 1}),
                          timeout=10)
    assert response.status_code == 200
