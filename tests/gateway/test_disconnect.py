"""A client that leaves makes the engine stop generating, streaming or not, long before it would end."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import raw_post, wait_for

SLOW = {"ttft_ms": 50, "itl_ms": 50, "tokens": 2400}  # 2 minutes of generation
ABORT_WITHIN = 30.0  # s: far beyond a busy machine's delays, far below the generation time
PATIENT = {"first_byte": 600.0, "idle": 600.0, "total": 600.0}  # no gateway timeout ends a request here


def wait_until_aborted(engine) -> dict:
    """Poll until the engine has nothing running; its stats then, which show an abort, not an answer.

    Only the client's leaving can end a request this early: the engine would generate for 2 minutes.
    """
    wait_for(
        lambda: engine.stats()["running"] == 0,
        timeout=ABORT_WITHIN,
        what=lambda: f"engine still busy {ABORT_WITHIN:g} s after the client left: {engine.stats()}",
    )
    stats = engine.stats()
    assert stats["aborted"] == 1 and stats["finished"] == 0, stats
    return stats


def test_streaming_client_leaving_mid_stream_aborts_the_engine_request(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts=PATIENT))
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body(stream=True)) as response:
            chunks = response.iter_raw()
            assert next(chunks).startswith(b"data: ")
            assert engine.stats()["running"] == 1
        # closing an unfinished response closes the connection
    wait_until_aborted(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_first_byte_aborts_the_engine_request(engines, gateway, stream):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts=PATIENT))
    body = chat_body(stream=stream, standin={"first_byte_delay_s": 120})
    with raw_post(f"{gw.url}/v1/chat/completions", body):
        wait_for(lambda: engine.stats()["started"] == 1)  # the engine has it; no byte came back
    wait_until_aborted(engine)  # the client left when the block closed its connection


def test_non_streaming_client_leaving_aborts_the_engine_request(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts=PATIENT))
    with raw_post(f"{gw.url}/v1/chat/completions", chat_body()) as client:  # the answer would take 2 minutes
        wait_for(lambda: engine.stats()["started"] == 1)
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):  # nothing comes back, and the client gives up
            client.recv(1)
    wait_until_aborted(engine)


@pytest.mark.one_process("reads the gateway's count of outstanding requests per engine")
def test_after_a_disconnect_the_engine_slot_and_connection_pool_recover(engines, gateway):
    (engine,) = engines(1, **SLOW)
    gw = gateway(fast_settings({"standin": [engine.url]}, timeouts=PATIENT))
    with raw_post(f"{gw.url}/v1/chat/completions", chat_body()):
        wait_for(lambda: engine.stats()["started"] == 1)
    wait_until_aborted(engine)
    wait_for(lambda: gw.engine("standin").outstanding == 0)  # released on the gateway's own thread
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", json=chat_body(standin={"tokens": 2, "itl_ms": 1}), timeout=10
    )
    assert response.status_code == 200
