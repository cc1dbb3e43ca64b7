"""Serving the gateway: uvicorn with our shutdown, in this process or in `workers` processes.

`serve(settings, models)` runs `serve_gateway` in this process when `settings.workers` is 1, else
`serve_workers`: this process becomes a supervisor of N worker processes (`python -m
server.gateway.server`), each a whole gateway (its own engine pool, health checks, scrapes,
prefix indexes and trimming caches) listening on the same port with SO_REUSEPORT, so the kernel
spreads new connections over them. The supervisor binds no listening socket itself: it checks
the port is free, holds it bound (not listening) so that port 0 picks one port for all, and
hands every worker the port. Their request metrics go to prometheus-client's multiprocess
files (PROMETHEUS_MULTIPROC_DIR, a directory the supervisor owns), so whichever worker answers
/metrics sums every worker's counters and histograms; the engines' figures it adds
(`gateway_engine_*`) are that worker's own scrape, exported once, never multiplied by N.

Shutdown (SIGINT or SIGTERM): /ready turns 503, the listening socket closes, in-flight requests
and streams get `limits.shutdown_grace` seconds to finish, then `serve_gateway` returns (so a
launcher can stop the engines it started). A second SIGINT stops at once. The supervisor
forwards each signal to every worker (they run in their own process group, so a terminal's
Ctrl-C reaches them once, through it) and returns when all have exited. A worker that exits on its own
makes the supervisor stop the others (they drain) and return 1: the container or service
manager restarts the gateway. A supervisor that dies without a word (SIGKILL) takes its workers
along: each asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG) and also
watches its parent id, so no worker outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Protocol

import uvicorn

from server.config import ServedModel
from server.gateway.edge.protocol import protocol_for
from server.gateway.settings import GatewaySettings, worker_count

log = logging.getLogger("gateway")


class Drainable(Protocol):
    """What the server tells the app on shutdown: `draining` turns /ready to 503."""

    draining: bool


class GatewayServer(uvicorn.Server):
    """uvicorn with our signal handling: mark the gateway as draining, never re-raise the signal
    after a graceful exit (the engines still have to be stopped), a second SIGINT forces exit."""

    def __init__(self, config: uvicorn.Config, state: Drainable | None = None) -> None:
        super().__init__(config)
        self.gateway_state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # tests run it in a thread
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.gateway_state is not None:
            self.gateway_state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            if not self.should_exit:
                log.info(
                    "shutting down: finishing in-flight requests (up to %g s)",
                    self.config.timeout_graceful_shutdown or 0,
                )
            self.should_exit = True


def uvicorn_config(app: Any, settings: GatewaySettings, headers: Sequence[tuple[str, str]] = ()) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_for(settings),
        lifespan="on",
        backlog=2048,
        # uvicorn hints an int but waits with asyncio, so a fraction of a second works (tests use it).
        timeout_graceful_shutdown=settings.limits.shutdown_grace,  # type: ignore[arg-type]
        timeout_keep_alive=30,
        access_log=False,
        log_config=None,
        proxy_headers=False,
        headers=list(headers),  # on every response, in the head only (no cost per chunk)
    )


async def serve(settings: GatewaySettings, models: Sequence[ServedModel]) -> int:
    """Serve the gateway with `settings.workers` processes until SIGINT/SIGTERM; the exit code."""
    count = worker_count(settings.workers)
    if count == 1:
        await serve_gateway(settings, models)
        return 0
    return await serve_workers(settings, models, count)


async def serve_gateway(settings: GatewaySettings, models: Sequence[ServedModel]) -> None:
    """Serve the gateway for `models` in this process until SIGINT/SIGTERM, then drain."""
    from server.gateway.app import create_app

    app = create_app(settings, models)
    server = GatewayServer(uvicorn_config(app, settings), app.state)
    _freeze_heap()
    log.info("gateway on http://%s:%d/v1 serving %s", settings.host, settings.port, _served(models))
    await server.serve()


def _freeze_heap() -> None:
    # Everything alive now (modules, pydantic schemas, the app) lives as long as the process:
    # keep it out of the garbage collector's full passes, which otherwise stall every stream
    # for tens of milliseconds now and then.
    gc.collect()
    gc.freeze()


def _served(models: Sequence[ServedModel]) -> str:
    served = ", ".join(f"{model.name} ({len(model.urls)} engine{'s' * (len(model.urls) != 1)})" for model in models)
    return served or "no models"


# -- several processes on one port --------------------------------------------------------------

SUPERVISOR_ENV = "GATEWAY_SUPERVISOR_PID"  # set for a worker: the pid it must not outlive
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it at import
WORKER_HEADER = "x-gateway-worker"  # every response of a worker names it (0..N-1)
METRICS_DIR_PREFIX = "gateway-metrics-"  # + the supervisor's pid, under the temporary directory
PARENT_CHECK_INTERVAL = 1.0  # seconds between two looks at the worker's parent id


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to `host:port` with SO_REUSEPORT, for workers to join.

    First a bind without SO_REUSEPORT: it fails (OSError EADDRINUSE) if anything listens there,
    including an older gateway whose sockets have SO_REUSEPORT, which the workers would otherwise
    silently share the port with. Port 0 picks a free port (read it from the socket)."""
    if port != 0:
        with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
            probe.bind((host, port))
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def worker_socket(host: str, port: int) -> socket.socket:
    """One worker's own socket on the shared port (uvicorn calls listen on it)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
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
            settings.host, port, _served(models), count, " ".join(str(w.pid) for w in workers),
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
        sys.executable, "-m", "server.gateway.server",
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


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux; elsewhere the id watch below)."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def _watch_parent(server: GatewayServer, parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 (nothing to wait on: the kernel tells no one)
        await asyncio.sleep(PARENT_CHECK_INTERVAL)
    log.warning("the gateway supervisor (pid %d) is gone: shutting down", parent)
    server.handle_exit(signal.SIGTERM, None)


async def _serve_worker(spec: dict[str, Any], parent: int) -> None:
    from server.gateway.app import create_app
    from server.gateway.observability.metrics import GatewayMetrics

    settings: GatewaySettings = spec["settings"]
    metrics = GatewayMetrics(multiprocess_dir=os.environ[MULTIPROC_ENV])
    app = create_app(settings, spec["models"], metrics=metrics)
    config = uvicorn_config(app, settings, headers=[(WORKER_HEADER, str(spec["index"]))])
    server = GatewayServer(config, app.state)
    sock = worker_socket(settings.host, spec["port"])
    watch = asyncio.ensure_future(_watch_parent(server, parent))
    _freeze_heap()
    try:
        await server.serve(sockets=[sock])
    finally:
        watch.cancel()
        sock.close()


def worker_main() -> int:
    """A worker process: its spec (pickled) on stdin, its supervisor's pid in the environment."""
    if SUPERVISOR_ENV not in os.environ or MULTIPROC_ENV not in os.environ:
        print("a gateway worker is started by `python -m server serve --workers N`", file=sys.stderr)
        return 2
    parent = int(os.environ[SUPERVISOR_ENV])
    _die_with_parent()
    if os.getppid() != parent:  # the supervisor died before the line above
        return 1
    spec = pickle.load(sys.stdin.buffer)
    configure_logging(spec["settings"])
    run(_serve_worker(spec, parent))
    return 0


def configure_logging(settings: GatewaySettings) -> None:
    from server.gateway.observability.logs import configure_logging as configure

    configure(settings.log_format)
    # httpx logs every request at INFO: noise, and real CPU on the hot path.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop, the loop the gateway is measured on."""
    import uvloop

    return uvloop.run(main)


if __name__ == "__main__":
    sys.exit(worker_main())
