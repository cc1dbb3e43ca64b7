"""One worker process of `--workers N` (`python -m server.gateway.serving.worker`): its spec on stdin."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
from typing import Any

from server.gateway.serving.process import GatewayServer, configure_logging, freeze_heap, run, uvicorn_config
from server.gateway.serving.supervisor import MULTIPROC_ENV, SUPERVISOR_ENV, WORKER_HEADER, family
from server.gateway.settings import GatewaySettings

log = logging.getLogger("gateway")

PARENT_CHECK_INTERVAL = 1.0  # seconds between two looks at the worker's parent id


def worker_socket(host: str, port: int) -> socket.socket:
    """One worker's own socket on the shared port (uvicorn calls listen on it)."""
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


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
    freeze_heap()
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


if __name__ == "__main__":
    sys.exit(worker_main())
