"""The processes a benchmark starts: pinned to a core, logged to files, and stopped by their own ids."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Started:
    """A process a benchmark started (the leader of its own process group)."""

    name: str
    argv: list[str]
    process: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Processes:
    """Starts processes pinned with `taskset`; `close()` stops every one of them, and only them."""

    def __init__(self, log_dir: Path | None = None):
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="bench-logs-"))
        self.started: list[Started] = []
        self.taskset = shutil.which("taskset")

    def pinned(self, core: int | None, argv: list[str]) -> list[str]:
        if core is None or self.taskset is None:
            return argv
        return [self.taskset, "-c", str(core), *argv]

    def start(self, name: str, argv: list[str], *, core: int | None, env: dict | None = None) -> Started:
        log = self.log_dir / f"{name}.log"
        full = self.pinned(core, argv)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **(env or {})},
            )  # fmt: skip
        started = Started(name, full, process, log)
        self.started.append(started)
        return started

    def stop(self, started: Started, timeout: float = 10.0) -> None:
        if started.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(started.pid, signal.SIGTERM)
        try:
            started.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started.pid, signal.SIGKILL)
            started.process.wait(5)

    def close(self) -> None:
        for started in reversed(self.started):
            self.stop(started)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_chat_ready(
    started: Started, base_url: str, model: str, timeout: float = 60.0, *, api_key: str | None = None
) -> str | None:
    """Poll with a small streaming chat request (with `api_key` as its bearer token, if given) until
    it answers 200; None, or why it never did."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    deadline = time.monotonic() + timeout
    last = "no answer"
    body = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "stream": True, "max_tokens": 2}
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        while time.monotonic() < deadline:
            if started.process.poll() is not None:
                return f"exited with status {started.process.returncode}:\n{started.log_tail()}"
            try:
                with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
                    text = response.read().decode(errors="replace")
                if response.status_code == 200 and "[DONE]" in text:
                    return None
                last = f"status {response.status_code}: {text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
    return f"not ready within {timeout:.0f} s (last: {last})\n{started.log_tail()}"


STANDIN_MODEL = "standin"
STANDIN_TIMING = {"ttft_ms": 20, "itl_ms": 10, "tokens": 32}  # 34 SSE chunks per answer


def loadgen_argv(
    url: str,
    *,
    concurrency: int,
    duration: float,
    warmup: float,
    cpu: dict[str, int],
    extra: Sequence[str] = (),
) -> list[str]:
    """The load generator's command line (bench/loadgen.py): `concurrency` streams of the stand-in's
    model against `url`, measuring the CPU of `cpu`'s processes (name -> pid). Not pinned: pin it
    with `Processes.pinned` or taskset."""
    return [
        PYTHON, "-m", "bench.loadgen", "--url", url, "--model", STANDIN_MODEL,
        "--concurrency", str(concurrency), "--duration", str(duration), "--warmup", str(warmup),
        *[arg for name, pid in cpu.items() for arg in ("--cpu", f"{name}={pid}")],
        *extra,
    ]  # fmt: skip


def start_standin(procs: Processes, *, core: int | None, tokens: int | None = None) -> tuple[Started, str]:
    """The benches' stand-in engine (standin/, STANDIN_TIMING, or `tokens` per answer): its
    process and its URL."""
    port = free_port()
    timing = {**STANDIN_TIMING, **({"tokens": tokens} if tokens else {})}
    argv = [PYTHON, "-m", "standin", "--port", str(port), "--model", STANDIN_MODEL,
            "--ttft-ms", str(timing["ttft_ms"]), "--itl-ms", str(timing["itl_ms"]),
            "--tokens", str(timing["tokens"]), "--max-model-len", "32768"]  # fmt: skip
    return procs.start("standin", argv, core=core), f"http://127.0.0.1:{port}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_code(workdir: Path, source: str) -> Path:
    """Where a gateway imports `server` from (run it with `python -P` and this as PYTHONPATH): a copy
    of commit `source` (others may be editing the working tree meanwhile), or the tree."""
    if source == "tree":
        return ROOT
    target = workdir / f"code-{source}"
    target.mkdir()
    # The gateway's packages at that commit: `server`, and `http1` once it exists (else the copy would
    # import the working tree's http1 through the editable install).
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", source], check=True, capture_output=True)
    packages = [name for name in ("server", "http1") if name in listed.stdout.decode().split()]
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", source, *packages], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def commit_of(source: str) -> str:
    if source == "tree":
        return "working tree"
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", source], capture_output=True, text=True)
    return done.stdout.strip() or source
