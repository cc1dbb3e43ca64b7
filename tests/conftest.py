"""Session-wide fixtures: one real vLLM engine on the tiny model, shared by every test that needs it.

The engine is started through the project's own supervisor (`python -m server engine`), exactly
as an operator would, once per session (about 40 s). Set TEST_ENGINE_URL to reuse an engine that
already runs (while developing); then the supervisor tests that stop the engine are skipped.

A shared engine that crashes is restarted by its supervisor. Every test that uses one (the
session's chat and embedding engines) first waits for it to serve (bounded: a test never starts
against an engine that is coming back, and fails saying the engine crashed if it does not come
back); a test that fails while its engine crashed waits for the restart too, so the next tests
find it serving, and its failure says that the engine crashed during it (tests/engine_process.py).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from server.engine.profiles import Profile, load_profile
from server.engine.supervisor import prepare
from tests.engine_process import EngineProcess, SharedEngine, running_engine
from tests.support import free_port

# Property tests have no per-example time limit: a busy machine makes an example slow, not wrong.
hypothesis_settings.register_profile("tests", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("tests")

ROOT = Path(__file__).resolve().parent.parent
TINY_PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu.yaml"
ENGINE_START_TIMEOUT = float(os.environ.get("TEST_ENGINE_START_TIMEOUT", "420"))


@dataclass
class RealEngine(SharedEngine):
    """A running vLLM engine serving the tiny model."""

    url: str  # base URL, without /v1
    model: str
    profile: Profile
    max_model_len: int
    process: subprocess.Popen | None  # the supervisor, when this session started it
    log_path: Path | None

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"


# The shared engines started so far, by fixture name (the hooks below wait for them).
SHARED_ENGINES: dict[str, SharedEngine] = {}


# Groups of shared engines, by fixture name (real_replicas: a list of two).
SHARED_ENGINE_GROUPS: dict[str, list[SharedEngine]] = {}


def _shared_engines(item: pytest.Item) -> list[SharedEngine]:
    names = getattr(item, "fixturenames", ())
    singles = [SHARED_ENGINES[name] for name in names if name in SHARED_ENGINES]
    return singles + [engine for name in names for engine in SHARED_ENGINE_GROUPS.get(name, [])]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a test's fixtures: its shared engines serve (after a crash, their restart)."""
    for engine in _shared_engines(item):
        engine.wait_until_serving()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that fails while a shared engine crashed says so, once the engine serves again."""
    engines = _shared_engines(item)
    before = [engine.engine_pid() for engine in engines]
    logged = [engine.log_size() for engine in engines]
    try:
        return (yield)
    except (Exception, pytest.fail.Exception) as failure:
        for engine, pid, since in zip(engines, before, logged, strict=True):
            if not engine.serving() or (pid is not None and engine.engine_pid() not in (pid, None)):
                waited = engine.wait_until_serving()
                failure.add_note(
                    f"the shared {engine.profile.name} engine crashed during this test "
                    f"(its supervisor had it serving again {waited:.0f} s after the test ended)"
                    + engine.crash_lines(since)
                )
        raise


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """A module's last test, once everything of it was torn down, collects the garbage: what the
    module leaked (an unclosed socket, file or transport) fails that test's teardown, naming it,
    and not whichever later test a full collection happens to run in."""
    result = yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        leaked: list[str] = []
        previous = sys.unraisablehook
        sys.unraisablehook = lambda unraisable: leaked.append(f"{unraisable.exc_value}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", ResourceWarning)
                gc.collect()
        finally:
            sys.unraisablehook = previous
        if leaked:
            raise AssertionError(f"{item.path.name} left garbage that was never closed: " + "; ".join(leaked))
    return result


def pytest_collection_modifyitems(config, items):
    """Tests that stop the shared engine run last."""
    items.sort(key=lambda item: item.get_closest_marker("stops_engine") is not None)


def pytest_configure(config):
    config.addinivalue_line("markers", "stops_engine: stops the session's engine; runs last")


@pytest.fixture(scope="session")
def real_engine(tmp_path_factory) -> RealEngine:
    profile = load_profile(TINY_PROFILE)
    reuse = os.environ.get("TEST_ENGINE_URL")
    if reuse:
        url = reuse.rstrip("/").removesuffix("/v1")
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        SHARED_ENGINES["real_engine"] = RealEngine(
            url, models[0]["id"], profile, models[0]["max_model_len"], None, None
        )
        yield SHARED_ENGINES["real_engine"]
        SHARED_ENGINES.pop("real_engine", None)
        return

    port = free_port()
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    log_file = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "engine", str(TINY_PROFILE), "--port", str(port)],
        cwd=ROOT,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            log_file.close()
            pytest.fail(f"the engine supervisor exited with {process.returncode}:\n" + log_path.read_text()[-4000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(process)
            log_file.close()
            pytest.fail(
                f"the engine did not become healthy in {ENGINE_START_TIMEOUT:.0f} s:\n" + log_path.read_text()[-4000:]
            )
        time.sleep(0.5)
    sys.stderr.write(f"\n[tests] real vLLM engine ready at {url} in {time.monotonic() - started:.1f} s\n")
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    engine = RealEngine(url, models[0]["id"], profile, models[0]["max_model_len"], process, log_path)
    SHARED_ENGINES["real_engine"] = engine
    try:
        yield engine
    finally:
        SHARED_ENGINES.pop("real_engine", None)
        _stop(process)
        log_file.close()


@pytest.fixture(scope="session")
def real_embed_engine(tmp_path_factory):
    """The tiny model as an embedding model (configs/profiles/tiny-embed.yaml), once per session."""
    for engine in running_engine(
        ROOT / "configs" / "profiles" / "tiny-embed.yaml",
        tmp_path_factory.mktemp("embed"),
        reuse_env="TEST_EMBED_ENGINE_URL",
    ):
        SHARED_ENGINES["real_embed_engine"] = engine
        try:
            yield engine
        finally:
            SHARED_ENGINES.pop("real_embed_engine", None)


ROUTING_PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-routing.yaml"


@pytest.fixture(scope="session")
def real_replicas(tmp_path_factory) -> list[EngineProcess]:
    """Two real tiny engines of tiny-cpu-routing.yaml (small KV caches, KV events), started in
    parallel, once per session, each under its own supervisor (`python -m server engine`), so a
    test that kills an engine (`engine.engine_pid()`) sees it restarted. Set TEST_REPLICA_URLS
    (two URLs, comma-separated) to reuse engines that already run."""
    profile = load_profile(ROUTING_PROFILE)
    reuse = os.environ.get("TEST_REPLICA_URLS")
    if reuse:
        urls = [url.strip().rstrip("/").removesuffix("/v1") for url in reuse.split(",") if url.strip()]
        replicas = [EngineProcess(url, profile.served_model_name, profile, None, None) for url in urls]
    else:
        prepare(profile)  # the tiny model, built once here: two supervisors building it at once collide
        log_dir = tmp_path_factory.mktemp("replicas")
        replicas = []
        for index in range(2):
            port = free_port()
            log_path = log_dir / f"replica-{index}.log"
            with log_path.open("w") as log_file:
                process = subprocess.Popen(
                    [sys.executable, "-m", "server", "engine", str(ROUTING_PROFILE), "--port", str(port)],
                    cwd=ROOT,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            replicas.append(
                EngineProcess(f"http://127.0.0.1:{port}", profile.served_model_name, profile, process, log_path)
            )
    try:
        started = time.monotonic()
        for replica in replicas:
            replica.wait_until_serving(ENGINE_START_TIMEOUT - (time.monotonic() - started))
            replica.started_in_s = time.monotonic() - started
        sys.stderr.write(f"\n[tests] two tiny-cpu-routing replicas ready in {time.monotonic() - started:.1f} s\n")
        SHARED_ENGINE_GROUPS["real_replicas"] = list(replicas)
        yield replicas
    finally:
        SHARED_ENGINE_GROUPS.pop("real_replicas", None)
        for replica in replicas:
            if replica.process is not None:
                _stop(replica.process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
