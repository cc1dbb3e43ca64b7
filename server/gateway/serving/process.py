"""One gateway process: the app under uvicorn with our signal handling and drain (see serving)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Protocol

import uvicorn

from server.config import ServedModel
from server.gateway.http.seam import protocol_for
from server.gateway.settings import GatewaySettings

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


# Seconds an idle client connection stays open: longer than httpx's own 5 s pool expiry, so a client
# never sends on a connection the gateway is closing at the same moment (uvicorn's default is 5 s).
KEEP_ALIVE_S = 30


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
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,
        log_config=None,
        proxy_headers=False,
        headers=list(headers),  # on every response, in the head only (no cost per chunk)
    )


async def serve_gateway(settings: GatewaySettings, models: Sequence[ServedModel]) -> None:
    """Serve the gateway for `models` in this process until SIGINT/SIGTERM, then drain."""
    from server.gateway.app import create_app

    app = create_app(settings, models)
    server = GatewayServer(uvicorn_config(app, settings), app.state)
    freeze_heap()
    log.info("gateway on http://%s:%d/v1 serving %s", settings.host, settings.port, served(models))
    await server.serve()


def freeze_heap() -> None:
    # Everything alive now (modules, pydantic schemas, the app) lives as long as the process:
    # keep it out of the garbage collector's full passes, which otherwise stall every stream
    # for tens of milliseconds now and then.
    gc.collect()
    gc.freeze()


def served(models: Sequence[ServedModel]) -> str:
    served = ", ".join(f"{model.name} ({len(model.urls)} engine{'s' * (len(model.urls) != 1)})" for model in models)
    return served or "no models"


# -- several processes on one port --------------------------------------------------------------


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
