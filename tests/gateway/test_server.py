"""Graceful shutdown of the served gateway (server.gateway.serving)."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.serving.process import GatewayServer, uvicorn_config
from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import free_port, refuses_connections, wait_for, wait_http


def start_server(settings):
    app = create_app(settings, plan_deployment(settings.models).served_models(), registry=CollectorRegistry())
    server = GatewayServer(uvicorn_config(app, settings), app.state)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{settings.port}/health", timeout=15)
    return server, thread, app.state


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    first = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=20) as response:
            parts = []
            for chunk in response.iter_text():
                parts.append(chunk)
                first.set()
            result["text"] = "".join(parts)

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(10)
    return thread, result


def test_shutdown_lets_in_flight_streams_finish_and_refuses_new_connections(engines):
    (engine,) = engines(1, ttft_ms=5, itl_ms=25, tokens=40)  # a 1 s stream
    settings = fast_settings({"standin": [engine.url]}, port=free_port(), limits={"shutdown_grace": 10})
    server, thread, state = start_server(settings)
    url = f"http://127.0.0.1:{settings.port}"
    client, result = stream_in_background(url, chat_body(stream=True))

    server.handle_exit(signal.SIGTERM, None)
    assert state.draining
    # uvicorn closes its listening socket on the next tick of its main loop, while the stream runs.
    wait_for(lambda: refuses_connections(url), what="the listening socket to close")
    client.join(10)
    events = sse_events(result["text"])
    assert events[-1] == "[DONE]" and not any("error" in e for e in events)
    assert len(events) == 1 + 40 + 1  # role, 40 tokens, [DONE]
    thread.join(10)
    assert not thread.is_alive()


def test_streams_still_running_at_the_grace_deadline_end_with_an_error_event(engines):
    (engine,) = engines(1, ttft_ms=5, itl_ms=50, tokens=100)  # a 5 s stream
    settings = fast_settings({"standin": [engine.url]}, port=free_port(), limits={"shutdown_grace": 0.5})
    server, thread, _ = start_server(settings)
    client, result = stream_in_background(f"http://127.0.0.1:{settings.port}", chat_body(stream=True))
    server.handle_exit(signal.SIGTERM, None)
    client.join(10)
    thread.join(10)
    assert not thread.is_alive()
    events = sse_events(result["text"])
    assert json.loads(events[-2])["error"]["code"] == "gateway_shutdown"
    assert events[-1] == "[DONE]"
    assert len(events) < 1 + 100 + 1  # cut at the deadline, not run to its end
    wait_for(lambda: engine.stats()["running"] == 0, what="the engine's generation to be aborted too")


def test_a_second_sigint_forces_exit():
    settings = fast_settings({}, port=free_port())
    server = GatewayServer(uvicorn_config(object(), settings))
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert not server.force_exit  # SIGTERM again: still graceful
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit


@pytest.mark.parametrize("grace", [0.5, 30.0])
def test_the_grace_period_reaches_uvicorn_as_configured(grace):
    settings = fast_settings({}, port=free_port(), limits={"shutdown_grace": grace})
    assert uvicorn_config(object(), settings).timeout_graceful_shutdown == grace
