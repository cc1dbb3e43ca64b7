"""Gateway test fixtures: stand-in engines and gateways as real uvicorn servers on loopback.

Timing and disconnects only behave for real over sockets (in-process ASGI transports buffer whole
bodies), so every gateway and engine here is a real server.

Every test that takes the `gateway` fixture runs twice: with one worker (the gateway in a thread
of the test process) and with two (`--workers 2`: a supervisor and two worker processes on one
port, tests/gateway/workers_host.py). A test that reads the gateway's in-process state (its
engines' health, its caches) or hands it a Python callback has no second process to read: it is
marked `@pytest.mark.one_process("why")` and runs with one worker only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.app.application import GatewayApp
from server.gateway.http.seam import protocol_for
from server.gateway.serving.process import KEEP_ALIVE_S
from server.gateway.serving.supervisor import WORKER_HEADER
from server.gateway.settings import GatewaySettings, ModelEngines
from standin import Standin, StandinConfig, build_app
from tests.support import serve_in_thread, wait_for

ROOT = Path(__file__).resolve().parents[2]
WORKERS_START_TIMEOUT = 120.0  # fresh interpreters importing the gateway on a busy 2-core machine
WORKERS_STOP_TIMEOUT = 60.0  # SIGTERM to exit: in-flight streams get `limits.shutdown_grace`

# Stand-ins answer in ~10 ms unless a test needs them slower.
FAST_ENGINE = {"ttft_ms": 2.0, "itl_ms": 1.0, "tokens": 6}


@dataclass
class Engine:
    """A running stand-in engine and its runtime controls."""

    url: str
    app: Standin

    def faults(self, **faults: Any) -> None:
        httpx.post(f"{self.url}/_standin/faults", json=faults, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/_standin/stats", timeout=5).json()


@dataclass
class Gateway:
    """A running gateway: in this process (`app`), or `workers` processes seen from outside only."""

    url: str
    in_process: GatewayApp | None
    workers: int = 1

    @property
    def app(self) -> GatewayApp:
        if self.in_process is None:
            raise AssertionError(
                "the gateway runs in worker processes: a test that reads its in-process state is "
                "marked @pytest.mark.one_process(why)"
            )
        return self.in_process

    @property
    def state(self) -> Any:
        return self.app.state

    def engine(self, model: str, index: int = 0) -> Any:
        return self.state.upstreams.models[model].engines[index]

    def each_worker(self, method: str, path: str, **kwargs: Any) -> dict[str, httpx.Response]:
        """One answer from every worker (by `x-gateway-worker`; "0" in this process), each on a new
        connection, for what each worker process knows on its own (its engines, its adapters)."""
        answers: dict[str, httpx.Response] = {}

        def every() -> bool:
            with httpx.Client(timeout=30) as client:
                response = client.request(method, f"{self.url}{path}", headers={"connection": "close"}, **kwargs)
            answers.setdefault(response.headers.get(WORKER_HEADER, "0"), response)
            return len(answers) >= self.workers

        wait_for(every, interval=0.01, what=lambda: f"workers that answered: {sorted(answers)}")
        return answers

    def healthy(self, model: str) -> set[int]:
        """How many engines of `model` each worker counts healthy (its /ready)."""
        return {r.json()["models"][model]["healthy"] for r in self.each_worker("GET", "/ready").values()}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples `name{labels...}` in the gateway's /metrics (0 when absent):
        with several workers, whichever answers sums them all (prometheus multiprocess mode)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )


def fast_settings(models: dict[str, list[str]], **overrides: Any) -> GatewaySettings:
    """Settings with test-sized health checks and backoff; `overrides` as nested dicts.

    Timeouts are far beyond what a busy machine adds (a connection to a stand-in that takes over
    0.5 s there would mark it down); a test of a timeout sets its own.
    """
    data: dict[str, Any] = {
        "health": {"interval": 0.05, "timeout": 10.0, "unhealthy_after": 2, "healthy_after": 1},
        "retries": {"max_attempts": 3, "backoff": 0.01},
        "timeouts": {"connect": 10.0, "first_byte": 60.0, "idle": 60.0, "total": 120.0},
        "metrics_scrape_interval": 60.0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    data["models"] = [ModelEngines(name=name, urls=urls) for name, urls in models.items()]
    return GatewaySettings.model_validate(data)


@pytest.fixture
def engines() -> Iterator[Callable[..., list[Engine]]]:
    """start(n, **StandinConfig fields) -> n stand-in engines, stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(n: int = 1, **config: Any) -> list[Engine]:
            config = {**FAST_ENGINE, **config}
            out = []
            for _ in range(n):
                app = build_app(StandinConfig(**config))
                out.append(Engine(stack.enter_context(serve_in_thread(app)), app))
            return out

        yield start


WORKER_COUNTS = (1, 2)
WORKER_IDS = ["1-worker", "2-workers"]


@contextlib.contextmanager
def served_gateway(
    settings: GatewaySettings, models: list[Any], workers: int, log_dir: Path, **kwargs: Any
) -> Iterator[Gateway]:
    """A gateway for `models` (create_app's `kwargs`) while the block runs: in this process with one
    worker, else a process tree of `workers` (there `environ` becomes the processes' environment;
    nothing else can reach them). The `gateway` fixture and the module-wide gateways of the tables
    and the real-engine tests (`params=WORKER_COUNTS`) start theirs here."""
    if workers > 1:
        unknown = set(kwargs) - {"environ"}
        assert not unknown, f"{sorted(unknown)} cannot reach worker processes: mark the test one_process"
        with WorkerTree(settings, models, workers, kwargs.get("environ"), log_dir).serving() as url:
            yield Gateway(url, None, workers)
        return
    kwargs.setdefault("registry", CollectorRegistry())
    app = create_app(settings, models, **kwargs)
    # The gateway's own connection protocol, as `serve` runs it (http.seam).
    with serve_in_thread(app, http=protocol_for(settings), timeout_keep_alive=KEEP_ALIVE_S) as url:
        yield Gateway(url, app)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The `gateway` fixture's worker counts: 1 and 2, or 1 for a test marked one_process."""
    if "gateway_workers" in metafunc.fixturenames:
        one = metafunc.definition.get_closest_marker("one_process") is not None
        n = 1 if one else len(WORKER_COUNTS)
        metafunc.parametrize("gateway_workers", WORKER_COUNTS[:n], ids=WORKER_IDS[:n])


@pytest.fixture
def gateway(gateway_workers: int, tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """start(settings, **create_app kwargs) -> a gateway for settings.models, served on loopback,
    stopped after the test: in this process, or as a two-worker process tree (`served_gateway`)."""
    with contextlib.ExitStack() as stack:

        def start(settings: GatewaySettings, **kwargs: Any) -> Gateway:
            models = plan_deployment(settings.models).served_models()
            return stack.enter_context(served_gateway(settings, models, gateway_workers, tmp_path, **kwargs))

        yield start


class WorkerTree:
    """`python -m tests.gateway.workers_host`: a gateway supervisor and its workers on port 0."""

    def __init__(
        self,
        settings: GatewaySettings,
        models: list[Any],
        workers: int,
        environ: dict[str, str] | None,
        tmp_path: Path,
    ):
        loopback = settings.model_copy(update={"workers": workers, "host": "127.0.0.1", "port": 0})
        self.spec = {"settings": loopback, "models": models}
        self.workers = workers
        self.log = tmp_path / f"gateway-{os.getpid()}-{id(self)}.log"
        ours = ("GATEWAY_", "PROMETHEUS_MULTIPROC_DIR")  # the test's settings and environ only
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(ours)}, **(environ or {})}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        with self.log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.gateway.workers_host"],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=self.env,
            )  # fmt: skip
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(self.spec))
        process.stdin.close()
        pids: set[int] = set()
        try:
            url = wait_for(
                lambda: self._url(process), timeout=WORKERS_START_TIMEOUT, what=lambda: self.log_text()[-3000:]
            )
            pids.update(int(pid) for pid in re.findall(r"\d+", self._started_line()[1]))
            self._wait_for_every_worker(process, url)
            yield url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=WORKERS_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=30)
            for pid in pids:  # never leave a worker behind, even when the test failed
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Shown with the test's output when it fails.
            print(f"--- the {self.workers}-worker gateway's log (tail) ---\n{self.log_text()[-4000:]}")

    def _started_line(self) -> tuple[str, str]:
        """(url, pids) from the supervisor's start line, or ("", "") before it."""
        match = re.search(r"gateway on (http://[^/\s]+)/v1 serving .* workers \(pids ([\d ]+)\)", self.log_text())
        return (match[1], match[2]) if match else ("", "")

    def _url(self, process: subprocess.Popen[bytes]) -> str:
        if process.poll() is not None:
            raise AssertionError(f"the gateway exited ({process.returncode}):\n{self.log_text()[-3000:]}")
        return self._started_line()[0]

    def _wait_for_every_worker(self, process: subprocess.Popen[bytes], url: str) -> None:
        """Until each worker has answered a request (each new connection goes to one of them)."""
        seen: set[str] = set()

        def every() -> bool:
            self._url(process)
            with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=30) as client:
                response = client.get(f"{url}/health", headers={"connection": "close"})
                seen.add(response.headers.get(WORKER_HEADER, "?"))
            return len(seen - {"?"}) >= self.workers

        wait_for(every, timeout=WORKERS_START_TIMEOUT, interval=0.02, what=lambda: f"workers that answered: {seen}")


def chat_body(
    content: str = "hello there", *, model: str = "standin", stream: bool = False, **extra: Any
) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
