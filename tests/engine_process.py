"""One more real vLLM engine for a test session or module, started the way an operator starts one.

`running_engine(profile)` runs `python -m server engine PROFILE --port P` (the project's own
supervisor), waits for `/health`, yields the engine, and stops its whole process group after.
Set the `reuse_env` variable to the URL of an engine that already runs to use it instead.
The session's chat engine (`real_engine` in tests/conftest.py) is started the same way.

An engine shared by many tests can crash (a vLLM worker's SIGILL, an out-of-memory kill); its
supervisor then restarts it, which takes a back-off and a fresh start (about 40 s here).
`SharedEngine.wait_until_serving()` waits for that, bounded by RESTART_TIMEOUT, and fails the
test with "the shared ... engine crashed and did not come back within N s" otherwise;
`SharedEngine.client()` is an httpx client whose requests, when the engine refuses the
connection (nothing was sent) or vLLM answers that its engine core died under the request
(nothing was served), wait for the restart and go again. tests/conftest.py waits the same way
before every test that uses a shared engine, and names a crash in a test's failure, with the
lines of the engine's log that say why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine.profiles import Profile, load_profile
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = float(os.environ.get("TEST_ENGINE_START_TIMEOUT", "420"))
# A crashed engine's way back: the supervisor's back-off (1 s for a first crash) and a fresh
# start (40 s here, several minutes on a busy machine).
RESTART_TIMEOUT = float(os.environ.get("TEST_ENGINE_RESTART_TIMEOUT", str(START_TIMEOUT)))


def serving(url: str) -> bool:
    """Whether the engine at `url` answers /health with 200 now."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) children of `pid`, from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


class SharedEngine:
    """Waiting out a crash of an engine that many tests share (see the module doc).

    Needs `url`, `profile`, `process` (the supervisor, None for a reused engine) and `log_path`."""

    url: str
    profile: Profile
    process: subprocess.Popen[bytes] | None
    log_path: Path | None

    def serving(self) -> bool:
        return serving(self.url)

    def engine_pid(self) -> int | None:
        """vLLM's API server: the supervisor's child (None for a reused engine, or between two runs)."""
        if self.process is None:
            return None
        pids = child_pids(self.process.pid)
        return pids[0] if len(pids) == 1 else None

    def wait_until_serving(self, timeout: float = RESTART_TIMEOUT) -> float:
        """Seconds waited for /health (0.0: it answered at once); fails the test if the engine does
        not come back within `timeout` seconds or its supervisor has exited."""
        started = time.monotonic()
        while not self.serving():
            name = self.profile.name
            if self.process is not None and self.process.poll() is not None:
                pytest.fail(
                    f"the shared {name} engine is down and its supervisor exited with {self.process.returncode}"
                    + self._log_tail(),
                    pytrace=False,
                )
            if time.monotonic() - started > timeout:
                pytest.fail(
                    f"the shared {name} engine crashed and did not come back within {timeout:.0f} s "
                    f"(its supervisor restarts it: {self.url}/health never answered 200)" + self._log_tail(),
                    pytrace=False,
                )
            time.sleep(0.5)
        return time.monotonic() - started

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client whose requests, when they meet a dead engine, wait for its restart and go
        again (WaitsForRestart)."""
        return httpx.Client(transport=WaitsForRestart(self), **kwargs)

    def log_size(self) -> int:
        """Where the engine's log ends now (0 without a log): the start of `crash_lines`."""
        return self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0

    def crash_lines(self, since: int, limit: int = 30) -> str:
        """The lines of its log written after offset `since` that say why an engine died."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        said = [line for line in text.splitlines() if CRASH_WORDS.search(line)][-limit:]
        return "\nwhat its log said:\n" + "\n".join(said) if said else ""

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\nlast lines of its log:\n" + self.log_path.read_text(errors="replace")[-3000:]


# Log lines that say why an engine died (vLLM's errors, a dead worker, the supervisor's restart).
CRASH_WORDS = re.compile(r"ERROR|Error|Traceback|died|exited with code|Killed|signal")

# What vLLM's API server answers (500) when its engine core died under a request: the request was
# not served, and the server exits next, so the supervisor restarts it.
ENGINE_DEAD = "EngineCore encountered an issue"
RETRIES = 3  # restarts waited for per request before its failure is the test's


class WaitsForRestart(httpx.BaseTransport):
    """A transport that meets a dead engine by waiting for its supervisor to bring it back, then
    sends the request once more: a refused connection (the engine down, nothing sent) or vLLM's
    500 for an engine core that died under the request (nothing served). Up to RETRIES times."""

    def __init__(self, engine: SharedEngine, transport: httpx.BaseTransport | None = None) -> None:
        self.engine = engine
        self.transport = transport or httpx.HTTPTransport()
        self.waited: list[float] = []  # seconds, per restart waited for

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for _ in range(RETRIES):
            try:
                response = self.transport.handle_request(request)
            except httpx.ConnectError:
                self.waited.append(self.engine.wait_until_serving())
                continue
            if response.status_code != 500:
                return response
            body = response.read()
            response.close()
            if ENGINE_DEAD.encode() not in body:
                return httpx.Response(500, headers=response.headers, content=body, request=request)
            self.waited.append(self.engine.wait_until_serving())
        return self.transport.handle_request(request)

    def close(self) -> None:
        self.transport.close()


@dataclass
class EngineProcess(SharedEngine):
    """A running vLLM engine of a profile."""

    url: str  # base URL, without /v1
    model: str
    profile: Profile
    process: subprocess.Popen[bytes] | None  # the supervisor, when this run started it
    log_path: Path | None
    started_in_s: float | None = None

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"


def running_engine(profile_path: Path, log_dir: Path, *, reuse_env: str) -> Iterator[EngineProcess]:
    """Start an engine of `profile_path` (or reuse `$reuse_env`), yield it, stop it."""
    profile = load_profile(profile_path)
    reuse = os.environ.get(reuse_env)
    if reuse:
        url = reuse.rstrip("/").removesuffix("/v1")
        yield EngineProcess(url, profile.served_model_name, profile, None, None)
        return
    port = free_port()
    log_path = log_dir / f"{profile.name}.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "engine", str(profile_path), "--port", str(port)],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            started = time.monotonic()
            while True:
                if process.poll() is not None:
                    pytest.fail(
                        f"the {profile.name} engine exited with {process.returncode}:\n" + log_path.read_text()[-4000:]
                    )
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > START_TIMEOUT:
                    pytest.fail(
                        f"the {profile.name} engine was not healthy in {START_TIMEOUT:.0f} s:\n"
                        + log_path.read_text()[-4000:]
                    )
                time.sleep(0.5)
            took = time.monotonic() - started
            sys.stderr.write(f"\n[tests] {profile.name} engine ready at {url} in {took:.1f} s\n")
            yield EngineProcess(url, profile.served_model_name, profile, process, log_path, took)
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the supervisor (it stops its engine's process group), SIGKILL to the group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
