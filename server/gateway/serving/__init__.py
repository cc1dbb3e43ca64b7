"""Serving the gateway: uvicorn with our shutdown, in this process or in `workers` processes.

    serving.process     one gateway process: uvicorn, our signal handling, the drain
    serving.supervisor  N worker processes on one port (SO_REUSEPORT), watched
    serving.worker      one such worker (`python -m server.gateway.serving.worker`)


`serve(settings, models)` runs `serve_gateway` in this process when `settings.workers` is 1, else
`serve_workers`: this process becomes a supervisor of N worker processes (`python -m
server.gateway.serving.worker`), each a whole gateway (its own engine pool, health checks, scrapes,
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
Ctrl-C reaches them once, through it) and returns when all have exited. A worker that dies is
replaced (same index and port, with a back-off; `gateway_worker_restarts_total`) while the others
keep serving; past `limits.worker_restarts_per_minute` the supervisor stops the others (they
drain) and returns 1, for the container or service manager to restart the gateway. A supervisor
that dies without a word (SIGKILL) takes its workers along: each asks the kernel for SIGTERM when
its parent dies (PR_SET_PDEATHSIG) and also watches its parent id, so no worker outlives it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from server.config import ServedModel
from server.gateway.serving.process import configure_logging, run, serve_gateway
from server.gateway.serving.supervisor import serve_workers
from server.gateway.settings import GatewaySettings, worker_count
from server.gateway.tenants.counters import QuotaStoreUnavailable, check_quota_store

log = logging.getLogger("gateway")

__all__ = ["configure_logging", "run", "serve", "serve_gateway", "serve_workers"]


async def serve(settings: GatewaySettings, models: Sequence[ServedModel]) -> int:
    """Serve the gateway with `settings.workers` processes until SIGINT/SIGTERM; the exit code."""
    count = worker_count(settings.workers)
    try:
        await check_quota_store(settings)  # quota_store.backend redis: its server answers, or no start
    except QuotaStoreUnavailable as exc:
        log.error("cannot serve: quota_store: %s", exc)
        return 2
    if count == 1:
        await serve_gateway(settings, models)
        return 0
    return await serve_workers(settings, models, count)
