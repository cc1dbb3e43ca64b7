"""`--workers N`: several gateway processes on one port (server.gateway.serving), as an operator runs them.

Every gateway here is a real `python -m server serve --workers 2` process tree (a supervisor and
two workers) in front of stand-in engines in this process. Each response names its worker
(`x-gateway-worker`); a new connection per request lets the kernel's SO_REUSEPORT spread them.
The end of this file runs the end-to-end tests that start a real gateway process (tests/gateway/
test_drain.py, tests/deploy/test_local.py) again with GATEWAY_WORKERS=2.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.config import SettingsError
from server.deploy import local
from server.gateway.serving.supervisor import METRICS_DIR_PREFIX, WORKER_HEADER, reserve_port
from server.gateway.settings import GatewaySettings, usable_cores, worker_count
from tests.gateway.conftest import chat_body, sse_events
from tests.support import free_port, refuses_connections, wait_for

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120.0  # two fresh interpreters importing the gateway on a busy 2-core machine


class Served:
    """A `python -m server serve --workers N` process tree and its log."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path):
        self.process, self.url, self.log = process, url, log

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        return children(self.process.pid)

    def ask(self, method: str = "GET", path: str = "/health", **kwargs) -> httpx.Response:
        """One request on a new connection (so that either worker may get it)."""
        with httpx.Client(timeout=30) as client:
            return client.request(method, f"{self.url}{path}", headers={"connection": "close"}, **kwargs)


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`, from /proc."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and alive(int(entry.name)):
            stat = _stat(int(entry.name))
            if stat is not None and int(stat[1]) == pid:
                out.append(int(entry.name))
    return out


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rfind(")") + 2 :].split()


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


@contextlib.contextmanager
def serve_workers(
    engine_url: str, tmp_path: Path, *extra: str, workers: int = 2, own_group: bool = False
) -> Iterator[Served]:
    port = free_port()
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--upstream", f"standin={engine_url}", "--port", str(port),
             "--workers", str(workers), *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k not in ("GATEWAY_API_KEYS", "GATEWAY_WORKERS")},
            process_group=0 if own_group else None,  # as a shell's job: Ctrl-C signals the whole group
        )  # fmt: skip
    served = Served(process, f"http://127.0.0.1:{port}", log)
    pids: list[int] = []
    try:
        wait_for(lambda: len(served.worker_pids()) == workers or process.poll() is not None, timeout=START_TIMEOUT)
        pids = served.worker_pids()
        yield served
    finally:
        pids = pids or served.worker_pids()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        for pid in pids:  # never leave a worker behind, even when the test failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def ready(served: Served) -> bool:
    if served.process.poll() is not None:
        raise AssertionError(served.log_text()[-3000:])
    try:
        return served.ask(path="/ready").status_code == 200
    except httpx.HTTPError:
        return False


def answering_workers(served: Served, want: int = 2, timeout: float = START_TIMEOUT) -> dict[str, int]:
    """Chat requests on new connections until `want` workers answered; {worker: requests answered}."""
    seen: dict[str, int] = {}

    def both() -> bool:
        if not ready(served):
            return False
        response = served.ask("POST", "/v1/chat/completions", json=chat_body())
        assert response.status_code == 200, response.text
        worker = response.headers[WORKER_HEADER]
        seen[worker] = seen.get(worker, 0) + 1
        return len(seen) >= want

    wait_for(both, timeout=timeout, interval=0.05, what=lambda: f"answers by worker: {seen}")
    return seen


def sample(text: str, name: str, **labels: str) -> list[float]:
    """The values of every sample `name{labels...}` in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if match and match[1] == name and all(f'{k}="{v}"' in (match[2] or "") for k, v in labels.items()):
            out.append(float(match[3]))
    return out


# -- the settings -------------------------------------------------------------------------------


def test_workers_is_a_number_or_auto():
    assert GatewaySettings(workers=3).workers == 3
    assert worker_count("auto") == usable_cores()
    assert worker_count("2") == 2
    for bad in ("0", "x", "300", "-1"):
        with pytest.raises(SettingsError):
            worker_count(bad)
    for bad_setting in (0, "x", 257):
        with pytest.raises(ValueError):
            GatewaySettings(workers=bad_setting)


def test_auto_is_capped_by_a_containers_cpu_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))
    cpu_max.write_text("50000 100000\n")  # half a core: one worker
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text("6400000 100000\n")  # 64 cores allowed, fewer here
    assert usable_cores(cpu_max) == len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "absent") == len(os.sched_getaffinity(0))


def test_the_flag_beats_the_environment_which_beats_the_config(tmp_path, monkeypatch):
    config = tmp_path / "gateway.yaml"
    config.write_text("workers: 3\n")
    monkeypatch.delenv("GATEWAY_WORKERS", raising=False)
    assert local._load(config, ["standin=http://127.0.0.1:1"], None, None)[0].workers == 3
    monkeypatch.setenv("GATEWAY_WORKERS", "4")
    assert local._load(config, ["standin=http://127.0.0.1:1"], None, None)[0].workers == 4
    assert local._load(config, ["standin=http://127.0.0.1:1"], None, None, "2")[0].workers == 2
    monkeypatch.setenv("GATEWAY_WORKERS", "many")
    with pytest.raises(SettingsError, match="workers"):
        local._load(config, ["standin=http://127.0.0.1:1"], None, None)


def test_a_port_another_gateway_listens_on_is_refused_even_with_so_reuseport():
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", other.getsockname()[1])
    with reserve_port("127.0.0.1", 0) as held:  # port 0: one port picked for every worker
        assert held.getsockname()[1] != 0


# -- two worker processes -----------------------------------------------------------------------


def test_two_workers_answer_on_one_port_and_metrics_sum_both(engines, tmp_path):
    (engine,) = engines(1)
    with serve_workers(engine.url, tmp_path) as served:
        assert len(served.worker_pids()) == 2
        answered = answering_workers(served)
        assert set(answered) == {"0", "1"}
        total = sum(answered.values())

        def counted() -> list[float]:
            text = served.ask(path="/metrics").text
            return [text] if sample(text, "gateway_requests_total", model="standin", code="200") == [total] else []

        # Whichever worker answers /metrics reports the requests of both.
        (text,) = wait_for(counted, what=lambda: served.ask(path="/metrics").text[-2000:])
        assert sample(text, "gateway_requests_in_flight", model="standin") == [0.0]
        # The engine's figures come from the answering worker's own scrape: one series, not two.
        assert sample(text, "gateway_engine_up", model="standin") == [1.0]
        assert engine.stats()["started"] >= total


def test_sigterm_drains_both_workers_and_leaves_no_process(engines, tmp_path):
    (engine,) = engines(1, ttft_ms=2, itl_ms=2, tokens=8)
    streams = 12
    with serve_workers(engine.url, tmp_path, "--config", str(_grace(tmp_path, 30))) as served:
        pids = served.worker_pids()
        answering_workers(served)  # both listen: a worker still starting gets no connection
        engine.faults(hold=True)
        results: list[tuple[str, list[str]]] = []

        def stream(i: int) -> None:
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST", f"{served.url}/v1/chat/completions", json=chat_body(f"s{i}", stream=True),
                    headers={"connection": "close"},
                ) as response,
            ):  # fmt: skip
                text = "".join(response.iter_text())
            results.append((response.headers.get(WORKER_HEADER, "?"), sse_events(text)))

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for client in clients:
            client.start()
        wait_for(lambda: engine.stats()["held"] == streams, timeout=60, what=engine.stats)
        served.process.send_signal(signal.SIGTERM)
        wait_for(lambda: refuses_connections(served.url), timeout=60, what="both workers to close their sockets")
        assert all(alive(pid) for pid in pids)  # draining: still running with streams in flight
        httpx.post(f"{engine.url}/_standin/release", timeout=5).raise_for_status()
        for client in clients:
            client.join(120)
        assert served.process.wait(timeout=120) == 0
        assert len(results) == streams
        assert all(events[-1] == "[DONE]" and len(events) == 1 + 8 + 1 for _, events in results), results[:2]
        # 12 connections over two SO_REUSEPORT sockets all on one: a 1-in-2048 chance.
        assert {worker for worker, _ in results} == {"0", "1"}
        wait_for(lambda: not any(alive(pid) for pid in pids), what="the workers to exit")
        log = served.log_text()
        assert "shutting down 2 workers" in log
        leftover = f"{METRICS_DIR_PREFIX}{served.process.pid}-"
        assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(leftover)]


def test_ctrl_c_in_a_terminal_drains_instead_of_cutting_streams(engines, tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group. A worker in that
    group would get it twice (from the terminal and from the supervisor): a second SIGINT forces
    an exit and cuts its streams. Workers run in their own group, so each gets one SIGINT."""
    (engine,) = engines(1, ttft_ms=2, itl_ms=2, tokens=8)
    with serve_workers(engine.url, tmp_path, "--config", str(_grace(tmp_path, 30)), own_group=True) as served:
        wait_for(lambda: ready(served), timeout=START_TIMEOUT)
        engine.faults(hold=True)
        results: list[list[str]] = []

        def stream(i: int) -> None:
            body = chat_body(f"c{i}", stream=True)
            with httpx.Client(timeout=120) as client:
                text = client.post(f"{served.url}/v1/chat/completions", json=body, headers={"connection": "close"}).text
            results.append(sse_events(text))

        clients = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for client in clients:
            client.start()
        wait_for(lambda: engine.stats()["held"] == 6, timeout=60, what=engine.stats)
        os.killpg(served.process.pid, signal.SIGINT)
        wait_for(lambda: refuses_connections(served.url), timeout=60, what="both workers to close their sockets")
        httpx.post(f"{engine.url}/_standin/release", timeout=5).raise_for_status()
        for client in clients:
            client.join(120)
        assert served.process.wait(timeout=120) == 0
        assert [events[-1:] for events in results] == [["[DONE]"]] * 6
        assert all(len(events) == 1 + 8 + 1 for events in results), results[:2]


def test_a_killed_supervisor_leaves_no_orphan(engines, tmp_path):
    (engine,) = engines(1)
    with serve_workers(engine.url, tmp_path, "--config", str(_grace(tmp_path, 5))) as served:
        answering_workers(served)  # both run (past their start-up) and serve
        pids = served.worker_pids()
        assert len(pids) == 2
        served.process.kill()
        served.process.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=60, what="the workers to follow their parent")


def _grace(tmp_path: Path, seconds: float) -> Path:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"limits:\n  shutdown_grace: {seconds}\n")
    return config


# -- the end-to-end tests of a real gateway process, again with two workers ---------------------


@pytest.fixture
def two_workers(monkeypatch):
    """GATEWAY_WORKERS=2 for every `python -m server serve` the test starts."""
    monkeypatch.setenv("GATEWAY_WORKERS", "2")


def test_drain_of_20_streams_with_two_workers(two_workers, engines, tmp_path):
    from tests.gateway import test_drain

    test_drain.test_sigterm_during_20_streams_finishes_every_stream_and_accepts_nothing_new(engines, tmp_path)


def test_serve_end_to_end_with_two_workers(two_workers):
    from tests.deploy import test_local

    test_local.test_serve_command_end_to_end_with_sigterm()


def test_serve_with_a_config_with_two_workers(two_workers, tmp_path):
    from tests.deploy import test_local

    test_local.test_serve_with_a_config_expects_a_profile_models_engines_on_its_planned_ports(tmp_path)
