"""N gateway worker processes on one port, started, watched and replaced by this process (see serving).

A worker that dies while the gateway is not stopping (SIGKILL, out of memory, a crash) is
replaced: the same index on the same port (SO_REUSEPORT, so the kernel sends new connections to
the workers still listening meanwhile), after a back-off of `limits.worker_restart_backoff`
seconds, doubled for each death of that worker in the last minute, up to
`limits.worker_restart_backoff_max`. The streams the dead worker carried are cut (nothing can
save them); the other workers serve on. Its live gauges are dropped from the shared metrics
directory (`multiprocess.mark_process_dead`; its counters stay in the sums), and the replacement
is counted in `gateway_worker_restarts_total{worker}` (a file there that every worker's /metrics
reads, observability.metrics). More than `limits.worker_restarts_per_minute` restarts in the
last 60 s (all workers together) means the supervisor cannot keep the workers up: it says so,
stops the others (they drain) and returns 1, for the container or service manager to act.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence

from server.config import ServedModel
from server.gateway.observability.metrics import WORKER_RESTARTS_FILE
from server.gateway.serving.process import served
from server.gateway.settings import GatewaySettings, Limits
from server.gateway.tenants.counters_host import WORKER_INDEX_ENV, host_quota_env

log = logging.getLogger("gateway")

SUPERVISOR_ENV = "GATEWAY_SUPERVISOR_PID"  # set for a worker: the pid it must not outlive
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it at import
WORKER_HEADER = "x-gateway-worker"  # every response of a worker names it (0..N-1)
METRICS_DIR_PREFIX = "gateway-metrics-"  # + the supervisor's pid, under the temporary directory
RESTART_WINDOW = 60.0  # seconds: the "per minute" of limits.worker_restarts_per_minute


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


class RestartBudget:
    """Which deaths may be followed by a restart, and after how long (times are `time.monotonic()`).

    `died(index, now)` records a death and returns the back-off before its restart, or None when
    the restarts of the last RESTART_WINDOW seconds already reach the limit."""

    def __init__(self, limits: Limits) -> None:
        self.per_minute = limits.worker_restarts_per_minute
        self.backoff = limits.worker_restart_backoff
        self.backoff_max = limits.worker_restart_backoff_max
        self.restarts: deque[float] = deque()  # when each restart of the window was granted
        self.deaths: dict[int, deque[float]] = {}  # per worker index, within the window

    def died(self, index: int, now: float) -> float | None:
        deaths = self.deaths.setdefault(index, deque())
        deaths.append(now)
        for times in (self.restarts, deaths):
            while times and times[0] <= now - RESTART_WINDOW:
                times.popleft()
        if len(self.restarts) >= self.per_minute:
            return None
        self.restarts.append(now)
        return float(min(self.backoff * 2 ** (len(deaths) - 1), self.backoff_max))

    def in_window(self) -> int:
        return len(self.restarts)


def exit_reason(returncode: int) -> str:
    """`exited with status 3`, `was killed by SIGKILL`: how a worker ended, for the log."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _Workers:
    """The live worker of each index, kept up until `stop` or until the budget runs out."""

    def __init__(
        self, settings: GatewaySettings, models: Sequence[ServedModel], port: int, env: dict[str, str], metrics_dir: str
    ) -> None:
        self.settings, self.models, self.port, self.env = settings, list(models), port, env
        self.metrics_dir = metrics_dir
        self.current: dict[int, asyncio.subprocess.Process] = {}
        self.restarts: dict[int, int] = {}
        self.budget = RestartBudget(settings.limits)
        self.stopping = False
        self.failed = False
        self._stopped = asyncio.Event()

    def stop(self, sig: int) -> None:
        if not self.stopping:
            log.info("shutting down %d workers: finishing in-flight requests (up to %g s)",
                     len(self.current), self.settings.limits.shutdown_grace)  # fmt: skip
        self.stopping = True
        self._stopped.set()
        for worker in self.current.values():
            _signal(worker, sig)

    async def run(self, count: int) -> None:
        self._write_restarts({index: 0 for index in range(count)})
        for index in range(count):
            if not await self._start(index):
                return
        log.info(
            "gateway on http://%s:%d/v1 serving %s with %d workers (pids %s)",
            self.settings.host, self.port, served(self.models), count,
            " ".join(str(w.pid) for w in self.current.values()),
        )  # fmt: skip
        await asyncio.gather(*(self._keep(index) for index in range(count)))

    async def _keep(self, index: int) -> None:
        while True:
            worker = self.current[index]
            started = time.monotonic()
            returncode = await worker.wait()
            _forget_worker(worker.pid, self.metrics_dir)
            if self.stopping:
                return
            now = time.monotonic()
            delay = self.budget.died(index, now)
            how = f"worker {index} (pid {worker.pid}) {exit_reason(returncode)} after {now - started:.1f} s"
            if delay is None:
                log.error(
                    "%s; it is not restarted: %d restarts in the last %g s is the limit "
                    "(limits.worker_restarts_per_minute), the workers cannot be kept up: stopping the others",
                    how, self.budget.in_window(), RESTART_WINDOW,
                )  # fmt: skip
                self.failed = True
                self.stop(signal.SIGTERM)
                return
            log.warning("%s: restarting it in %.2f s (%d of %d restarts allowed per minute)",
                        how, delay, self.budget.in_window(), self.budget.per_minute)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)
            if self.stopping:
                return
            if not await self._start(index):
                return
            self.restarts[index] = self.restarts.get(index, 0) + 1
            self._write_restarts(self.restarts)
            log.info("worker %d restarted (pid %d)", index, self.current[index].pid)

    async def _start(self, index: int) -> bool:
        """Start worker `index` (False, the others stopped, when no process can be started)."""
        try:
            worker = await _start_worker(self.settings, self.models, index, self.port, self.env)
        except OSError as exc:
            log.error("cannot start worker %d: %s: stopping the others", index, exc)
            self.failed = True
            self.stop(signal.SIGTERM)
            return False
        self.current[index] = worker
        if self.stopping:  # a signal came while it started: it drains with the others
            _signal(worker, signal.SIGTERM)
        return True

    def _write_restarts(self, restarts: dict[int, int]) -> None:
        """The restart counts where every worker's /metrics reads them (whole, by rename)."""
        counts = {str(index): restarts.get(index, 0) for index in sorted({*restarts, *self.current})}
        path = os.path.join(self.metrics_dir, WORKER_RESTARTS_FILE)
        with open(f"{path}.tmp", "w") as out:
            json.dump(counts, out)
        os.replace(f"{path}.tmp", path)

    def live(self) -> list[asyncio.subprocess.Process]:
        return [worker for worker in self.current.values() if worker.returncode is None]


def _signal(worker: asyncio.subprocess.Process, sig: int) -> None:
    if worker.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            worker.send_signal(sig)


async def serve_workers(settings: GatewaySettings, models: Sequence[ServedModel], count: int) -> int:
    """Run `count` worker processes on `settings.port` until SIGINT/SIGTERM (see the module doc);
    0 after a drain, 1 when the port is taken or the workers could not be kept up."""
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
    env.update(host_quota_env(settings, metrics_dir, count))  # one set of quota counters for all workers
    workers = _Workers(settings, models, port, env, metrics_dir)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, workers.stop, sig)
    try:
        await workers.run(count)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await _reap(workers.live(), settings.limits.shutdown_grace + 10.0)
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if workers.failed else 0


async def _start_worker(
    settings: GatewaySettings, models: Sequence[ServedModel], index: int, port: int, env: dict[str, str]
) -> asyncio.subprocess.Process:
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server.gateway.serving.worker",
        stdin=asyncio.subprocess.PIPE, env={**env, WORKER_INDEX_ENV: str(index)},
        # Its own process group: a terminal's Ctrl-C reaches it through the supervisor only, once.
        # Not its own session: that would also be its own scheduler autogroup, a different share
        # of the CPU from the supervisor it belongs to.
        preexec_fn=os.setpgrp,
    )  # fmt: skip
    assert worker.stdin is not None
    # Our own child on a pipe: pickle carries the settings and models exactly as planned here.
    # A worker killed before it read them has closed the pipe: its exit is seen by the caller.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
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
    """Wait for workers still running (they were signalled, or an error happened here), SIGTERM
    then SIGKILL after `timeout`."""
    if not workers:
        return
    for worker in workers:
        _signal(worker, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(worker.wait() for worker in workers)), timeout)
    except (TimeoutError, asyncio.CancelledError):
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
