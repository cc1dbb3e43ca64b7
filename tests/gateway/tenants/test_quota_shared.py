"""Quotas shared by gateway processes, as an operator runs them (`python -m server serve`): the
`--workers 2` of one host on the local store (the supervisor's counters file), and two gateways on
one real redis-server. Exact counts with requests sent at once on new connections (so the kernel
spreads them over the workers), a worker or a gateway killed mid-request, Redis gone mid-run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from server.gateway.serving.supervisor import WORKER_HEADER
from server.gateway.tenants import counters_redis
from tests.gateway.conftest import chat_body
from tests.gateway.tenants.redis_server import RedisServer
from tests.gateway.worker_tree import alive, children, sample
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT = 120.0  # fresh interpreters importing the gateway on a busy 2-core machine
RATE, CONC = "sk-rate", "sk-conc"
N = 5  # requests per window of the tenant `rate`
PASSWORD = "s3cret-pw"


def config(tmp_path: Path, name: str, backend: str, concurrent: int) -> Path:
    data = {
        "tenants": [
            # One request back every 600 / N = 120 s: none while the test runs.
            {"name": "rate", "api_keys": [RATE], "limits": {"requests_per_minute": N, "window_seconds": 600}},
            {"name": "conc", "api_keys": [CONC], "limits": {"max_concurrent": concurrent}},
        ],
        "quota_store": {"backend": backend},
        "health": {"interval": 0.5, "timeout": 10.0},
        "timeouts": {"connect": 10.0, "first_byte": 120.0, "idle": 120.0, "total": 300.0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[int]:
        return children(self.process.pid)


def start_gateway(
    tmp_path: Path, engine_url: str, name: str, *, workers: int = 1, backend: str = "local",
    redis_url: str | None = None, concurrent: int = 2,
) -> Gateway:  # fmt: skip
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "PROMETHEUS_MULTIPROC_DIR"))}
    if redis_url is not None:
        env["GATEWAY_REDIS_URL"] = redis_url
    log = tmp_path / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--config", str(config(tmp_path, name, backend, concurrent)),
             "--upstream", f"standin={engine_url}", "--port", str(port), "--workers", str(workers)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    return Gateway(process, f"http://127.0.0.1:{port}", port, log)


@contextlib.contextmanager
def serving(*gateways: Gateway, workers: int = 1) -> Iterator[None]:
    """Until every gateway answers /ready from each of its workers; stopped (none left) after."""
    pids: list[int] = []
    try:
        for gw in gateways:
            answered: set[str] = set()

            def ready(gw: Gateway = gw, answered: set[str] = answered) -> bool:
                if gw.process.poll() is not None:
                    raise AssertionError(f"the gateway exited {gw.process.returncode}:\n{gw.log_text()[-3000:]}")
                try:
                    r = httpx.get(f"{gw.url}/ready", headers={"connection": "close"}, timeout=10)
                except httpx.HTTPError:
                    return False
                if r.status_code == 200:
                    answered.add(r.headers.get(WORKER_HEADER, "0"))
                return len(answered) >= workers

            wait_for(ready, timeout=START_TIMEOUT, interval=0.05, what=lambda gw=gw: gw.log_text()[-3000:])
            pids += gw.workers()
        yield
    finally:
        for gw in gateways:
            if gw.process.poll() is None:
                gw.process.send_signal(signal.SIGTERM)
        for gw in gateways:
            try:
                gw.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                gw.process.kill()
                gw.process.wait(timeout=30)
            print(f"--- {gw.log.name} (tail) ---\n{gw.log_text()[-3000:]}")
        for pid in pids:  # never leave a worker behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def post(url: str, key: str, timeout: float = 120) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "connection": "close"}  # a new connection: any worker
    return httpx.post(f"{url}/v1/chat/completions", json=chat_body(), headers=headers, timeout=timeout)


def at_once(urls: list[str], key: str, count: int) -> list[httpx.Response]:
    """`count` requests sent together, spread over `urls` in turn."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: post(urls[i % len(urls)], key), range(count)))


def assert_exactly_n_of_3n(answers: list[httpx.Response]) -> None:
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) == N and len(refused) == 2 * N, [a.status_code for a in answers]
    for answer in answers:
        assert answer.headers["x-ratelimit-limit-requests"] == str(N)
        assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
    # Each admitted request saw the one shared bucket after its own take: N-1 ... 0, once each.
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in ok) == list(range(N))
    for answer in refused:
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        assert answer.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(answer.headers["retry-after"]) <= 600 / N
        assert 0 < int(answer.headers["retry-after-ms"]) <= 600_000 / N


def assert_concurrency_exact(engine, urls: list[str], limit: int) -> None:
    """3 x `limit` requests at once while the engine holds them: `limit` reach it, the rest 429."""
    engine.faults(hold=True)
    with concurrent.futures.ThreadPoolExecutor(3 * limit) as pool:
        answers = [pool.submit(post, urls[i % len(urls)], CONC) for i in range(3 * limit)]
        wait_for(lambda: len([f for f in answers if f.done()]) == 2 * limit, timeout=120)
        assert len([f for f in answers if f.done() and f.result().status_code == 429]) == 2 * limit
        assert engine.stats()["held"] == limit  # one set of slots: not `limit` per process
        for f in answers:
            if f.done():
                assert "concurrent requests: the limit is" in f.result().json()["error"]["message"]
                assert f.result().headers["retry-after"] == "1"
        httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        assert sorted(f.result().status_code for f in answers) == [200] * limit + [429] * (2 * limit)


# -- one host, --workers 2, the local store ------------------------------------------------------


def test_two_workers_count_one_set_of_requests_and_slots(engines, tmp_path):
    [engine] = engines(1)
    gw = start_gateway(tmp_path, engine.url, "gw", workers=2)
    with serving(gw, workers=2):
        answers = at_once([gw.url], RATE, 3 * N)
        assert {a.headers[WORKER_HEADER] for a in answers} == {"0", "1"}  # both workers took part
        assert_exactly_n_of_3n(answers)
        assert engine.stats()["started"] == N
        assert_concurrency_exact(engine, [gw.url], limit=2)


def owner_of(client_port: int, server_port: int, pids: list[int]) -> int:
    """The process holding the server side of the TCP connection from `client_port` (/proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
                if local == server_port and remote == client_port:
                    inodes.add(fields[9])
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes:
                    return pid
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def held_request(port: int, key: str) -> socket.socket:
    """A chat request on a raw connection, left waiting for its answer."""
    body = b'{"model": "standin", "messages": [{"role": "user", "content": "hold"}]}'
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_a_worker_killed_mid_request_leaves_no_slot_behind(engines, tmp_path):
    [engine] = engines(1)
    gw = start_gateway(tmp_path, engine.url, "gw", workers=2, concurrent=1)
    with serving(gw, workers=2):
        engine.faults(hold=True)
        with held_request(gw.port, CONC) as sock:
            wait_for(lambda: engine.stats()["held"] == 1, timeout=60)
            assert post(gw.url, CONC).status_code == 429  # the one slot is taken, whichever worker asks
            holder = owner_of(sock.getsockname()[1], gw.port, gw.workers())
            os.kill(holder, signal.SIGKILL)
            wait_for(lambda: not alive(holder), timeout=60)
            with contextlib.suppress(OSError):
                assert sock.recv(1024) == b""  # its client's connection went with it
        httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        # The bound: the very next request that needs the slot gets it (the survivor finds the dead
        # worker's row unowned and zeroes it; a replacement zeroes its row when it opens the file).
        answers = [post(gw.url, CONC) for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]


# -- two gateways, one Redis ----------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path, password=PASSWORD).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
def test_two_gateways_on_one_redis_count_one_set_of_requests_and_slots(engines, tmp_path, redis_server):
    [engine] = engines(1)
    a = start_gateway(tmp_path, engine.url, "a", backend="redis", redis_url=redis_server.url)
    b = start_gateway(tmp_path, engine.url, "b", backend="redis", redis_url=redis_server.url)
    with serving(a, b):
        assert_exactly_n_of_3n(at_once([a.url, b.url], RATE, 3 * N))
        assert engine.stats()["started"] == N
        assert_concurrency_exact(engine, [a.url, b.url], limit=2)
    for gw in (a, b):
        assert PASSWORD not in gw.log_text()


@pytest.mark.redis
def test_a_gateway_killed_mid_request_frees_its_slot_within_one_lease(engines, tmp_path, redis_server):
    [engine] = engines(1)
    a = start_gateway(tmp_path, engine.url, "a", backend="redis", redis_url=redis_server.url, concurrent=1)
    b = start_gateway(tmp_path, engine.url, "b", backend="redis", redis_url=redis_server.url, concurrent=1)
    with serving(a, b):
        engine.faults(hold=True)
        with held_request(a.port, CONC):
            wait_for(lambda: engine.stats()["held"] == 1, timeout=60)
            assert post(b.url, CONC).status_code == 429
            a.process.send_signal(signal.SIGKILL)
            a.process.wait(timeout=30)
            # Its slot's lease ends at most SLOT_LEASE seconds from now (Redis's clock).
            [_, lease_end] = redis_server.call("ZRANGE", "gateway:quota:{conc}:slots", "0", "-1", "WITHSCORES")
            seconds, micros = redis_server.call("TIME")
            assert float(lease_end) <= int(seconds) + int(micros) / 1e6 + counters_redis.SLOT_LEASE
        httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        wait_for(lambda: post(b.url, CONC).status_code == 200, timeout=counters_redis.SLOT_LEASE + 60, interval=0.2)


@pytest.mark.redis
def test_redis_gone_mid_run_lets_requests_in_unchecked_then_quotas_hold_again(engines, tmp_path, redis_server):
    [engine] = engines(1)
    gw = start_gateway(tmp_path, engine.url, "gw", backend="redis", redis_url=redis_server.url)
    with serving(gw):
        assert [post(gw.url, RATE).status_code for _ in range(N + 1)] == [200] * N + [429]
        redis_server.stop()
        over = [post(gw.url, RATE) for _ in range(3)]  # fail open: over quota, let in, no headers
        assert [a.status_code for a in over] == [200] * 3
        assert not [h for a in over for h in a.headers if h.startswith("x-ratelimit")]
        metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
        assert sample(metrics, "gateway_quota_unchecked_total", tenant="rate") == [3.0]
        assert "is unreachable" in gw.log_text() and PASSWORD not in gw.log_text()
        redis_server.start()  # back (empty: a fresh window)
        wait_for(lambda: "x-ratelimit-limit-requests" in post(gw.url, RATE).headers, timeout=60, interval=0.2)
        wait_for(lambda: post(gw.url, RATE).status_code == 429, timeout=60, interval=0.05)  # the quota holds


@pytest.mark.redis
def test_a_gateway_with_redis_and_no_server_is_refused_at_start_with_the_reason(engines, tmp_path, redis_server):
    [engine] = engines(1)
    url = redis_server.url
    redis_server.stop()
    for redis_url, reason in (
        (url, "cannot reach the Redis server at redis://127.0.0.1"),
        (None, "$GATEWAY_REDIS_URL"),
    ):
        gw = start_gateway(tmp_path, engine.url, "gw", workers=2, backend="redis", redis_url=redis_url)
        assert gw.process.wait(timeout=START_TIMEOUT) == 2
        assert reason in gw.log_text() and PASSWORD not in gw.log_text()
