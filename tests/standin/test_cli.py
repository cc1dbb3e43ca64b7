"""`python -m standin`: the benches' flags reach the engine, `--help` says what each does, and the
process faults (for supervisor tests) exit, crash and leave a grandchild as they say."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import free_port, wait_for, wait_http

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("--host", "--port", "--model", "--ttft-ms", "--itl-ms", "--tokens", "--max-model-len")


@contextlib.contextmanager
def standin_process(*args: str, new_group: bool = False) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = free_port()
    argv = [sys.executable, "-m", "standin", "--port", str(port), *args]
    process = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=new_group
    )
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_help_names_every_flag_and_the_runtime_controls():
    result = subprocess.run(
        [sys.executable, "-m", "standin", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for flag in (*FLAGS, "--prompt-tokens-details", "--exit-now", "--crash-after", "--grandchild-pidfile"):
        assert flag in result.stdout, flag
    assert "python -m standin" in result.stdout and "/_standin/faults" in result.stdout


def test_the_benches_flags_reach_the_engine():
    with standin_process(
        "--model", "m", "--ttft-ms", "1", "--itl-ms", "1", "--tokens", "3", "--max-model-len", "100",
        "--prompt-tokens-details",
    ) as (_, url):  # fmt: skip
        wait_http(f"{url}/health")
        (card,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert (card["id"], card["max_model_len"]) == ("m", 100)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).json()
        assert answer["usage"]["completion_tokens"] == 3
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # reported, as the flag asks
        too_long = {**body, "max_tokens": 101}
        assert httpx.post(f"{url}/v1/chat/completions", json=too_long, timeout=10).status_code == 400


def test_exit_now_exits_with_a_fatal_error_before_serving():
    with standin_process("--exit-now") as (process, _):
        assert process.wait(timeout=60) == 3
        assert process.stdout is not None
        assert "fatal error at start-up" in process.stdout.read()


def test_crash_after_exits_once_healthy_and_leaves_the_grandchild_in_its_group(tmp_path):
    pidfile = tmp_path / "children"
    faults = ("--crash-after", "0.2", "--grandchild-pidfile", str(pidfile))
    with standin_process(*faults, new_group=True) as (process, url):
        wait_http(f"{url}/health")
        assert process.wait(timeout=60) == 1
        (grandchild,) = [int(pid) for pid in pidfile.read_text().split()]
        try:
            assert alive(grandchild)  # a crash takes nothing down with it
            assert os.getpgid(grandchild) == process.pid  # what a supervisor stops with the group
        finally:
            os.kill(grandchild, signal.SIGKILL)
        wait_for(lambda: not alive(grandchild))


@pytest.mark.parametrize("status", [200, 500])
def test_metrics_faults_serve_a_page_of_the_tests_own_until_reset(status):
    from standin import StandinConfig, build_app
    from tests.support import serve_in_thread

    with serve_in_thread(build_app(StandinConfig(model="m"))) as url:
        own = 'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
        faults = {"metrics_text": own, "metrics_status": status}
        httpx.post(f"{url}/_standin/faults", json=faults, timeout=10).raise_for_status()
        page = httpx.get(f"{url}/metrics", timeout=10)
        assert (page.status_code, page.text) == (status, own)
        httpx.post(f"{url}/_standin/faults", json={}, timeout=10).raise_for_status()
        page = httpx.get(f"{url}/metrics", timeout=10)
        assert page.status_code == 200 and "vllm:kv_cache_usage_perc" in page.text and own not in page.text
