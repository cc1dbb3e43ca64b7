"""`serve` and `up` on this host (server.deploy.local), run as an operator runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from standin import StandinConfig, build_app
from tests.engine.test_engine_e2e import alive, descendants
from tests.support import free_port, serve_in_thread, wait_for, wait_http

ROOT = Path(__file__).resolve().parents[2]
FAST_ENGINE = StandinConfig(ttft_ms=2.0, itl_ms=1.0, tokens=6)
CHAT = {"model": "standin", "messages": [{"role": "user", "content": "hello"}]}


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", *args], check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def serve_until_sigterm(*args: str) -> tuple[int, list[dict], httpx.Response]:
    """`python -m server serve ARGS` on a free port: one chat request, then SIGTERM.

    Returns the exit code, the JSON log lines and the answer to the request.
    """
    port = free_port()
    with subprocess.Popen(
        [sys.executable, "-m", "server", "serve", *args, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            wait_http(f"http://127.0.0.1:{port}/ready", timeout=30)
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=10)
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return process.returncode, lines, response


def test_serve_needs_models():
    done = run_cli("serve")
    assert done.returncode == 2 and "--upstream" in done.stderr


def test_serve_refuses_a_config_whose_profile_is_missing(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n  - profile: nowhere.yaml\n")
    done = run_cli("serve", "--config", str(config))
    assert done.returncode == 2 and "nowhere.yaml: no such profile file" in done.stderr


def test_serve_refuses_a_tenant_key_source_that_is_not_there_before_any_worker_starts(tmp_path):
    """Refused once, with the file and the key: not N workers failing their start-up in a restart loop."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "models:\n  - name: m\n    urls: [http://127.0.0.1:9]\n"
        "tenants:\n  - name: planner\n    api_keys_env: NO_SUCH_TENANT_KEYS_VARIABLE\n"
    )
    done = run_cli("serve", "--config", str(config), "--workers", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(config) in done.stderr and "NO_SUCH_TENANT_KEYS_VARIABLE" in done.stderr
    assert "restart" not in done.stdout + done.stderr


def test_up_refuses_a_profile_this_host_cannot_run(tmp_path):
    config = tmp_path / "gateway.yaml"
    profile = ROOT / "configs/profiles/chat-fp8.yaml"  # cannot run here (GPU, fp8 KV cache)
    config.write_text(f"models:\n  - profile: {profile}\n    base_port: {free_port()}\n")
    done = run_cli("up", "--config", str(config))
    assert done.returncode == 1 and "error: model llama-3.1-8b-instruct:" in done.stderr


def test_up_refuses_a_config_without_models(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("port: 8000\n")
    done = run_cli("up", "--config", str(config))
    assert done.returncode == 2 and "no models" in done.stderr


def test_serve_command_end_to_end_with_sigterm():
    with serve_in_thread(build_app(FAST_ENGINE)) as engine:
        code, lines, response = serve_until_sigterm("--upstream", f"standin={engine}")
    assert response.status_code == 200
    assert code == 0
    access = [line for line in lines if line.get("logger") == "gateway.access"]
    assert access and access[0]["status"] == 200 and access[0]["model"] == "standin"


def test_serve_with_a_config_expects_a_profile_models_engines_on_its_planned_ports(tmp_path):
    """The port `up` would start the engine on is the one the gateway is handed."""
    (tmp_path / "standin.yaml").write_text("model: org/standin\nserved_model_name: standin\ndevice: cpu\n")
    with serve_in_thread(build_app(FAST_ENGINE)) as engine:
        port = int(engine.rsplit(":", 1)[1])
        config = tmp_path / "gateway.yaml"
        config.write_text(f"models:\n  - profile: standin.yaml\n    base_port: {port}\n")
        code, lines, response = serve_until_sigterm("--config", str(config))
    assert response.status_code == 200, response.text
    assert code == 0
    access = [line for line in lines if line.get("logger") == "gateway.access"]
    assert access[0]["engine"] == f"127.0.0.1:{port}"


@pytest.mark.engine
def test_up_starts_the_planned_engines_serves_in_front_and_stops_them_on_sigterm(tmp_path):
    """`up` end to end on the real tiny engine: the engine on the plan's port, the gateway in front,
    and on SIGTERM the gateway drains, then every engine process is gone."""
    engine_port, gateway_port = free_port(), free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"models:\n  - profile: {ROOT / 'configs/profiles/tiny-cpu.yaml'}\n"
        f"    base_port: {engine_port}\nlimits:\n  shutdown_grace: 5\n"
    )
    log = tmp_path / "up.log"
    with (
        log.open("w") as out,
        subprocess.Popen(
            [sys.executable, "-m", "server", "up", "--config", str(config), "--port", str(gateway_port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ) as process,
    ):
        try:
            wait_http(f"http://127.0.0.1:{gateway_port}/ready", timeout=420)
            httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=5).raise_for_status()
            answer = httpx.post(
                f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
                timeout=60,
                json={
                    "model": "tiny",
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "hello"}],
                },
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
            tree = descendants(process.pid)
            assert tree, "expected the engine's processes under `up`"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 0, log.read_text()[-4000:]
            wait_for(
                lambda: not [pid for pid in tree if alive(pid)],
                interval=0.1,
                what=lambda: f"still alive: {[pid for pid in tree if alive(pid)]}",
            )
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert f"engine tiny:{engine_port} ready at http://127.0.0.1:{engine_port}" in text, text[-4000:]
    assert "stopping 1 engine(s)" in text
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2)
