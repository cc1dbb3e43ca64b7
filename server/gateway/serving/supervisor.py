"""N gateway worker processes on one port, started and watched by this process (see serving)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence

from server.config import ServedModel
from server.gateway.serving.process import served
from server.gateway.settings import GatewaySettings

log = logging.getLogger("gateway")

SUPERVISOR_ENV = "GATEWAY_SUPERVISOR_PID"  # set for a worker: the pid it must not outlive
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it at import
WORKER_HEADER = "x-gateway-worker"  # every response of a worker names it (0..N-1)
METRICS_DIR_PREFIX = "gateway-metrics-"  # + the supervisor's pid, under the temporary directory


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to `host:port` with SO_REUSEPORT, for workers to join.

    First a bind without SO_REUSEPORT: it fails (OSError EADDRINUSE) if anything listens there,
    including an older gateway whose sockets have SO_REUSEPORT, which the workers would otherwise
    silently share the port with. Port 0 picks a free port (read it from the socket)."""
    if port != 0:
        with socket.socket(family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
            probe.bind((host, port))
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve_workers(settings: GatewaySettings, models: Sequence[ServedModel], count: int) -> int:
    """Run `count` worker processes on `settings.port` until SIGINT/SIGTERM (see the module doc)."""
    try:
        reserved = reserve_port(settings.host, settings.port)
    except OSError as exc:
        reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        log.error("cannot serve on %s:%d: %s", settings.host, settings.port, reason)
        return 1
    port = reserved.getsockname()[1]
    _remove_stale_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    env = {**os.environ, MULTIPROC_ENV: metrics_dir, SUPERVISOR_ENV: str(os.getpid())}
    workers: list[asyncio.subprocess.Process] = []
    stopping = False
    failed = False
    loop = asyncio.get_running_loop()

    def stop(sig: int) -> None:
        nonlocal stopping
        if not stopping:
            log.info("shutting down %d workers: finishing in-flight requests (up to %g s)",
                     count, settings.limits.shutdown_grace)  # fmt: skip
        stopping = True
        for worker in workers:
            if worker.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    try:
        for index in range(count):
            workers.append(await _start_worker(settings, models, index, port, env))
        log.info(
            "gateway on http://%s:%d/v1 serving %s with %d workers (pids %s)",
            settings.host, port, served(models), count, " ".join(str(w.pid) for w in workers),
        )  # fmt: skip
        waits = {asyncio.ensure_future(worker.wait()): worker for worker in workers}
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                worker = waits.pop(task)
                _forget_worker(worker.pid, metrics_dir)
                if not stopping:
                    log.error("worker pid %d exited with status %s: stopping the others", worker.pid, task.result())
                    failed = True
                    stop(signal.SIGTERM)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await _reap(workers, settings.limits.shutdown_grace + 10.0)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failed else 0


async def _start_worker(
    settings: GatewaySettings, models: Sequence[ServedModel], index: int, port: int, env: dict[str, str]
) -> asyncio.subprocess.Process:
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.gateway.serving.worker",
        stdin=asyncio.subprocess.PIPE, env=env,
        # Its own process group: a terminal's Ctrl-C reaches it through the supervisor only, once.
        # Not its own session: that would also be its own scheduler autogroup, a different share
        # of the CPU from the supervisor it belongs to.
        preexec_fn=os.setpgrp,
    )  # fmt: skip
    assert worker.stdin is not None
    # Our own child on a pipe: pickle carries the settings and models exactly as planned here.
    worker.stdin.write(pickle.dumps({"settings": settings, "models": list(models), "index": index, "port": port}))
    await worker.stdin.drain()
    worker.stdin.close()
    return worker


def _remove_stale_metrics_dirs() -> None:
    """The metrics directories of supervisors that died without cleaning up (SIGKILL)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(METRICS_DIR_PREFIX):
            continue
        pid = name.removeprefix(METRICS_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _forget_worker(pid: int, metrics_dir: str) -> None:
    """Drop an exited worker's live gauges (its counters stay in the sums)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]


async def _reap(workers: list[asyncio.subprocess.Process], timeout: float) -> None:
    """Wait for workers still running (after an error here), SIGTERM then SIGKILL."""
    alive = [worker for worker in workers if worker.returncode is None]
    if not alive:
        return
    for worker in alive:
        with contextlib.suppress(ProcessLookupError):
            worker.terminate()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker.wait() for worker in alive)), timeout)
    except (TimeoutError, asyncio.CancelledError):
        for worker in alive:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
