"""Running `python -m server serve --workers N` as an operator does, and looking at its processes.

`serve_workers(engine_url, tmp_path)` starts a supervisor and its workers in front of an engine and
kills whatever is left after the block; `children`, `alive` read /proc; `answering_workers` sends
chat requests on new connections until each worker answered one; `sample` reads an exposition;
`Load` streams from 16 threads at once, each stream on a new connection.
Used by tests/gateway/test_workers.py.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from server.gateway.serving.supervisor import WORKER_HEADER
from tests.gateway.conftest import chat_body, sse_events
from tests.support import free_port, wait_for

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


@dataclass
class Streamed:
    """One stream of the load: the worker that answered (None: no head came), how it ended."""

    worker: str | None
    status: int | None
    events: list[str]
    error: str | None
    started_at: float  # time.perf_counter() before it connected
    headed_at: float  # time.perf_counter() when its head arrived (inf: never)

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.status == 200
            and self.events[-1:] == ["[DONE]"]
            and (len(self.events) == 1 + Load.TOKENS + 1)
        )


class Load:
    """`streams` threads, each streaming chat completions one after another, each on a new
    connection. `gate` holds new requests back (under `lock`) so that at a chosen moment every
    open connection has its head, and so a known worker."""

    TOKENS = 40  # chunks per stream the stand-in engine is told to send (tests/gateway/test_workers.py)

    def __init__(self, url: str, streams: int = 16) -> None:
        self.url = url
        self.results: list[Streamed] = []
        self.open: dict[int, str | None] = {}  # thread -> worker of its stream (None: head not yet in)
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            for n in itertools.count():
                while True:
                    self.gate.wait()
                    with self.lock:
                        if self.done.is_set():
                            return
                        if self.gate.is_set():
                            self.open[i] = None
                            break
                worker, status, text, error, headed = None, None, "", None, math.inf
                started = time.perf_counter()
                try:
                    body = chat_body(f"load {i}.{n}", stream=True)
                    headers = {"connection": "close"}
                    with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as r:
                        worker, status, headed = r.headers.get(WORKER_HEADER), r.status_code, time.perf_counter()
                        with self.lock:
                            self.open[i] = worker
                        text = "".join(r.iter_text())
                except httpx.HTTPError as exc:
                    error = repr(exc)
                with self.lock:
                    del self.open[i]
                    self.results.append(Streamed(worker, status, sse_events(text), error, started, headed))

    def stop(self) -> list[Streamed]:
        with self.lock:
            self.done.set()
            self.gate.set()
        for thread in self.threads:
            thread.join(120)
        return self.results


def pids_by_index(served: Served, count: int = 2) -> list[int]:
    found = re.search(rf"with {count} workers \(pids ([\d ]+)\)", served.log_text())
    assert found, served.log_text()[-3000:]
    return [int(pid) for pid in found[1].split()]


def scrapes_of_each_worker(served: Served) -> dict[str, str]:
    """/metrics as answered by each of the two workers."""
    seen: dict[str, str] = {}

    def both() -> bool:
        response = served.ask(path="/metrics")
        seen[response.headers[WORKER_HEADER]] = response.text
        return len(seen) == 2

    wait_for(both, interval=0.01, what=lambda: f"scrapes answered by {sorted(seen)}")
    return seen
