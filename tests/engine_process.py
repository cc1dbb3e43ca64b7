"""One more real vLLM engine for a test session or module, started the way an operator starts one.

`running_engine(profile)` runs `python -m server engine PROFILE --port P` (the project's own
supervisor), waits for `/health`, yields the engine, and stops its whole process group after.
Set the `reuse_env` variable to the URL of an engine that already runs to use it instead.
The session's chat engine (`real_engine` in tests/conftest.py) is started the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server.engine.profiles import Profile, load_profile
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = float(os.environ.get("TEST_ENGINE_START_TIMEOUT", "420"))


@dataclass
class EngineProcess:
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
