"""The session's shared vLLM engine crashes and comes back: tests wait for it (tests/engine_process.py).

The engine test kills vLLM's API server (not the project's supervisor, which restarts it), as a
SIGILL or an out-of-memory kill would, then sends a request through the helper that waits for the
restart. The others show, without an engine, what the wait does with a refused connection and how
it fails when the engine does not come back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.engine.profiles import load_profile
from tests.engine_process import ROOT, SharedEngine, WaitsForRestart
from tests.support import refusing_port, wait_for

TINY_PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu.yaml"


@pytest.mark.engine
def test_a_request_waits_for_the_supervisor_to_restart_a_killed_engine(real_engine):
    if real_engine.process is None:
        pytest.skip("TEST_ENGINE_URL: this session did not start the engine, nothing restarts it")
    killed = wait_for(real_engine.engine_pid, what="vLLM's API server under the supervisor")
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: not real_engine.serving(), what="the killed engine to stop answering")
    body = {"model": real_engine.model, "prompt": "Once", "max_tokens": 2}
    transport = WaitsForRestart(real_engine)  # what real_engine.client() uses
    with httpx.Client(transport=transport, timeout=60) as client:
        response = client.post(f"{real_engine.url}/v1/completions", json=body)
    waited = transport.waited
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    # The connection was refused, then the restart came (more waits: the new engine died as well).
    assert waited and waited[0] > 0
    restarted = real_engine.engine_pid()
    assert restarted is not None and restarted != killed
    assert real_engine.process.poll() is None  # the supervisor itself lives on


def test_a_refused_connection_is_retried_only_after_the_engine_serves_again():
    """Without a real engine: the transport waits for /health, then sends once more."""
    calls: list[str] = []

    class Engine:
        def wait_until_serving(self) -> float:
            calls.append("waited")
            return 1.5

    class Refusing(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            calls.append(request.method)
            if len(calls) == 1:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(200, json={"ok": True})

    transport = WaitsForRestart(Engine(), Refusing())  # type: ignore[arg-type]
    with httpx.Client(transport=transport) as client:
        assert client.post("http://engine/v1/completions", json={}).json() == {"ok": True}
    assert calls == ["POST", "waited", "POST"]
    assert transport.waited == [1.5]


def test_a_request_the_dead_engine_core_did_not_serve_goes_again_after_the_restart():
    """vLLM's 500 for an engine core that died under the request: wait for the restart, send again;
    any other 500 is the test's answer, and so is the third dead engine in a row."""
    calls: list[str] = []
    dead = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause."}}

    class Engine:
        def wait_until_serving(self) -> float:
            calls.append("waited")
            return 2.0

    class Dies(httpx.BaseTransport):
        def __init__(self, answers: list[httpx.Response]) -> None:
            self.answers = answers

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            calls.append(request.method)
            return self.answers.pop(0)

    transport = WaitsForRestart(Engine(), Dies([httpx.Response(500, json=dead), httpx.Response(200, json={})]))  # type: ignore[arg-type]
    with httpx.Client(transport=transport) as client:
        assert client.post("http://engine/v1/completions", json={}).status_code == 200
    assert calls == ["POST", "waited", "POST"]

    calls.clear()
    other = {"error": {"message": "boom"}}
    transport = WaitsForRestart(Engine(), Dies([httpx.Response(500, json=other)]))  # type: ignore[arg-type]
    with httpx.Client(transport=transport) as client:
        response = client.post("http://engine/v1/completions", json={})
    assert (response.status_code, response.json(), calls) == (500, other, ["POST"])

    calls.clear()
    transport = WaitsForRestart(Engine(), Dies([httpx.Response(500, json=dead) for _ in range(4)]))  # type: ignore[arg-type]
    with httpx.Client(transport=transport) as client:
        response = client.post("http://engine/v1/completions", json={})
    assert response.status_code == 500 and "EngineCore" in response.text
    assert calls == ["POST", "waited"] * 3 + ["POST"]


class _Down(SharedEngine):
    """An engine that is down: nothing listens at its URL."""

    def __init__(self, url: str, log_path: Path, process: subprocess.Popen[bytes] | None = None) -> None:
        self.url, self.log_path, self.process = url, log_path, process
        self.profile = load_profile(TINY_PROFILE)


def test_an_engine_that_does_not_come_back_fails_the_test_saying_it_crashed(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)\n")
    with refusing_port() as port:
        engine = _Down(f"http://127.0.0.1:{port}", log)
        with pytest.raises(pytest.fail.Exception) as failed:
            engine.wait_until_serving(timeout=1)
    message = str(failed.value)
    assert "the shared tiny-cpu engine crashed and did not come back within 1 s" in message
    assert "exit code: -4" in message  # the engine's last log lines say why


def test_an_engine_whose_supervisor_exited_fails_at_once(tmp_path):
    supervisor = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    supervisor.wait()
    with refusing_port() as port:
        engine = _Down(f"http://127.0.0.1:{port}", tmp_path / "absent.log", supervisor)
        with pytest.raises(pytest.fail.Exception, match="its supervisor exited with 3"):
            engine.wait_until_serving()  # the default, minutes long, is not waited out
