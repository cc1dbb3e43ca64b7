"""`--workers N`: several gateway processes on one port (server.gateway.serving), as an operator runs them.

Every gateway here is a real `python -m server serve --workers 2` process tree (a supervisor and
two workers) in front of stand-in engines in this process. Each response names its worker
(`x-gateway-worker`); a new connection per request lets the kernel's SO_REUSEPORT spread them.
A worker that dies is replaced (SIGKILL under a load of 16 streams), and one that keeps dying makes
the supervisor give up. The end of this file runs the end-to-end tests that start a real gateway
process (tests/gateway/test_drain.py, tests/deploy/test_local.py) again with GATEWAY_WORKERS=2.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.config import SettingsError
from server.deploy import local
from server.gateway.serving.supervisor import (
    METRICS_DIR_PREFIX,
    WORKER_HEADER,
    RestartBudget,
    exit_reason,
    reserve_port,
)
from server.gateway.settings import GatewaySettings, Limits, usable_cores, worker_count
from tests.gateway.conftest import chat_body, sse_events
from tests.gateway.worker_tree import (
    START_TIMEOUT,
    Load,
    alive,
    answering_workers,
    pids_by_index,
    ready,
    sample,
    scrapes_of_each_worker,
    serve_workers,
)
from tests.support import refuses_connections, wait_for

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
    return _limits(tmp_path, shutdown_grace=seconds)


def _limits(tmp_path: Path, **limits: float) -> Path:
    config = tmp_path / "gateway.yaml"
    config.write_text("limits:\n" + "".join(f"  {key}: {value}\n" for key, value in limits.items()))
    return config


# -- workers that die are replaced ---------------------------------------------------------------


def test_the_restart_budget_backs_off_per_worker_and_refuses_past_its_limit():
    budget = RestartBudget(Limits(worker_restarts_per_minute=3, worker_restart_backoff=0.5))
    assert budget.died(0, 100.0) == 0.5
    assert budget.died(0, 101.0) == 1.0  # worker 0's second death within a minute: doubled
    assert budget.died(1, 102.0) == 0.5  # worker 1's first
    assert budget.died(1, 103.0) is None  # three restarts in the last minute: the limit
    sliding = RestartBudget(
        Limits(worker_restarts_per_minute=2, worker_restart_backoff=1, worker_restart_backoff_max=3)
    )
    assert [sliding.died(0, t) for t in (0.0, 1.0)] == [1.0, 2.0]
    assert sliding.died(0, 60.5) == 2.0  # the restart at 0 s left the window, its death too
    assert sliding.died(0, 60.6) is None  # those at 1 s and 60.5 s have not
    capped = RestartBudget(
        Limits(worker_restarts_per_minute=10, worker_restart_backoff=1, worker_restart_backoff_max=3)
    )
    assert [capped.died(0, float(t)) for t in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert RestartBudget(Limits(worker_restarts_per_minute=0)).died(0, 0.0) is None  # 0: never restart


def test_restart_settings_are_checked():
    assert Limits().worker_restarts_per_minute >= 1  # by default a dead worker comes back
    for bad in ({"worker_restarts_per_minute": -1}, {"worker_restart_backoff": -0.1},
                {"worker_restart_backoff": 5, "worker_restart_backoff_max": 1}, {"worker_restarts": 3}):  # fmt: skip
        with pytest.raises(ValueError):
            GatewaySettings.model_validate({"limits": bad})


def test_exit_reasons_name_the_signal():
    assert exit_reason(-signal.SIGKILL) == "was killed by SIGKILL"
    assert exit_reason(-signal.SIGILL) == "was killed by SIGILL"
    assert exit_reason(3) == "exited with status 3"


def test_the_restart_metric_reads_the_supervisors_file(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from server.gateway.observability.metrics import WORKER_RESTARTS_FILE, WorkerRestarts

    registry = CollectorRegistry()
    registry.register(WorkerRestarts(tmp_path / WORKER_RESTARTS_FILE))
    assert sample(generate_latest(registry).decode(), "gateway_worker_restarts_total") == []  # no file yet
    (tmp_path / WORKER_RESTARTS_FILE).write_text('{"0": 2, "1": 0}')
    text = generate_latest(registry).decode()
    assert sample(text, "gateway_worker_restarts_total", worker="0") == [2.0]
    assert sample(text, "gateway_worker_restarts_total", worker="1") == [0.0]
    (tmp_path / WORKER_RESTARTS_FILE).write_text("{not json")
    assert sample(generate_latest(registry).decode(), "gateway_worker_restarts_total") == []


def test_a_killed_worker_is_replaced_while_16_streams_run_and_nothing_else_fails(engines, tmp_path):
    (engine,) = engines(1, ttft_ms=5, itl_ms=50, tokens=Load.TOKENS)
    config = _limits(tmp_path, shutdown_grace=5, worker_restart_backoff=0.2)
    with serve_workers(engine.url, tmp_path, "--config", str(config)) as served:
        warm = sum(answering_workers(served).values())
        killed, other = pids_by_index(served)
        load = Load(served.url, streams=16)
        killed_at = math.inf
        cut_candidates = 0

        def kill_while_both_stream() -> bool:
            """SIGKILL worker 0 at a moment when both workers carry streams and every open
            connection has its head (so each stream's worker is known)."""
            nonlocal killed_at, cut_candidates
            with load.lock:
                load.gate.clear()
            wait_for(lambda: None not in load.open.values(), timeout=120, what=lambda: load.open)
            with load.lock:
                on = list(load.open.values())
                if on.count("0") >= 1 and on.count("1") >= 1:
                    os.kill(killed, signal.SIGKILL)
                    killed_at, cut_candidates = time.perf_counter(), on.count("0")
                    return True
                load.gate.set()
                return False

        try:
            wait_for(lambda: len(load.open) == 16, timeout=60, what=lambda: load.open)
            wait_for(kill_while_both_stream, timeout=120, interval=0.1)
            # Until its last thread has exited (its leader is a zombie before that), its listening
            # socket is open and the kernel still hands it new connections, which its death then
            # resets: they are its connections too (SO_REUSEPORT moves none to another listener
            # unless net.ipv4.tcp_migrate_req is 1). So new ones wait until the supervisor has
            # reaped it; from then on only the other workers' sockets take connections.
            wait_for(lambda: not os.path.exists(f"/proc/{killed}"), what=f"worker pid {killed} to be reaped")
            load.gate.set()

            def served_after(worker: str, at_least: int) -> bool:
                after = [r for r in list(load.results) if r.worker == worker and r.headed_at > killed_at]
                return sum(r.ok for r in after) >= at_least

            # The replacement serves (index 0 again), and the load runs on both workers a while.
            wait_for(lambda: served_after("0", 16) and served_after("1", 16), timeout=START_TIMEOUT,
                     what=lambda: served.log_text()[-2000:])  # fmt: skip
        finally:
            results = load.stop()

        failed = [r for r in results if not r.ok]
        cut = [r for r in failed if r.worker == "0" and r.headed_at < killed_at]
        others = [(r, r.started_at - killed_at) for r in failed if r not in cut]
        assert not others, (
            f"{len(others)} failures outside the killed worker's streams (seconds after the kill): {others}"
        )
        assert 1 <= len(cut) <= cut_candidates
        assert all(r.ok for r in results if r.worker == "1")  # the other worker lost nothing, during the kill too
        assert any(r.worker == "1" and r.headed_at < killed_at for r in results)
        replacement = [pid for pid in served.worker_pids() if pid != other]
        assert len(replacement) == 1 and replacement[0] != killed and alive(other)
        log = served.log_text()
        assert f"worker 0 (pid {killed}) was killed by SIGKILL after" in log
        assert "restarting it in 0.20 s" in log
        assert f"worker 0 restarted (pid {replacement[0]})" in log
        ok = warm + sum(1 for r in results if r.ok)

        def settled() -> str:
            text = served.ask(path="/metrics").text
            return text if sample(text, "gateway_requests_total", model="standin", code="200") == [ok] else ""

        wait_for(settled, what=lambda: (ok, served.ask(path="/metrics").text[-3000:]))
        # Whichever worker answers: every finished request counted once (the dead one's too), the
        # cut streams no longer in flight (its live gauge dropped), the restart counted.
        for worker, text in scrapes_of_each_worker(served).items():
            assert sample(text, "gateway_requests_total", model="standin", code="200") == [ok], worker
            assert sum(sample(text, "gateway_requests_total", model="standin")) == ok, worker
            assert sample(text, "gateway_requests_in_flight", model="standin") == [0.0], worker
            assert sample(text, "gateway_worker_restarts_total", worker="0") == [1.0], worker
            assert sample(text, "gateway_worker_restarts_total", worker="1") == [0.0], worker
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=120) == 0
        wait_for(lambda: not any(alive(pid) for pid in (other, *replacement)), what="the workers to exit")


def test_a_worker_that_keeps_dying_makes_the_supervisor_stop_and_exit_1(engines, tmp_path):
    (engine,) = engines(1)
    config = _limits(tmp_path, shutdown_grace=5, worker_restarts_per_minute=1, worker_restart_backoff=0)
    with serve_workers(engine.url, tmp_path, "--config", str(config)) as served:
        answering_workers(served)
        first, other = pids_by_index(served)
        os.kill(first, signal.SIGKILL)
        # Its replacement dies too, as soon as it exists (before it has read its settings, even).
        (second,) = wait_for(lambda: [pid for pid in served.worker_pids() if pid not in (first, other)], timeout=60)
        assert served.ask("POST", "/v1/chat/completions", json=chat_body()).status_code == 200  # worker 1 serves on
        os.kill(second, signal.SIGKILL)
        assert served.process.wait(timeout=120) == 1
        log = served.log_text()
        assert f"worker 0 (pid {first}) was killed by SIGKILL" in log
        assert f"worker 0 restarted (pid {second})" in log
        assert (
            f"worker 0 (pid {second}) was killed by SIGKILL after" in log
            and "it is not restarted: 1 restarts in the last 60 s is the limit (limits.worker_restarts_per_minute)"
            in log
        ), log[-3000:]
        wait_for(lambda: not alive(other), what="the other worker to drain and exit")  # no orphan


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
