"""Graceful shutdown, and the two commands that run the gateway."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.gateway.app import create_app
from server.gateway.main import GatewayServer, uvicorn_config
from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import free_port, wait_http

ROOT = Path(__file__).resolve().parents[2]


def start_server(settings):
    app = create_app(settings, registry=CollectorRegistry(), profiles={})
    server = GatewayServer(uvicorn_config(app, settings), app.state.gateway)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{settings.port}/health", timeout=15)
    return server, thread, app.state.gateway


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
    time.sleep(0.3)  # uvicorn closes its listening socket on the next tick of its main loop
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
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
    started = time.perf_counter()
    server.handle_exit(signal.SIGTERM, None)
    client.join(10)
    thread.join(10)
    assert time.perf_counter() - started < 3
    events = sse_events(result["text"])
    assert json.loads(events[-2])["error"]["code"] == "gateway_shutdown"
    assert events[-1] == "[DONE]"
    deadline = time.monotonic() + 2
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0  # the engine's generation was aborted too


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_of_both_commands():
    for command in ("serve", "up"):
        done = run_cli(command, "--help")
        assert done.returncode == 0 and "--config" in done.stdout and "--port" in done.stdout
    assert "--upstream" in run_cli("serve", "--help").stdout


def test_serve_needs_models():
    done = run_cli("serve")
    assert done.returncode == 2 and "--upstream" in done.stderr


def test_up_refuses_a_profile_this_host_cannot_run(tmp_path):
    config = tmp_path / "gateway.yaml"
    profile = ROOT / "configs/profiles/chat-fp8.yaml"  # cannot run here (GPU, fp8 KV cache)
    config.write_text(f"models:\n  - profile: {profile}\n    base_port: {free_port()}\n")
    done = run_cli("up", "--config", str(config))
    assert done.returncode == 1 and "error:" in done.stderr


def test_serve_command_end_to_end_with_sigterm(engines):
    (engine,) = engines(1)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--upstream", f"standin={engine.url}", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=30)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(), timeout=10)
        assert response.status_code == 200
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("logger") == "gateway.access"]
    assert access and access[0]["status"] == 200 and access[0]["model"] == "standin"
