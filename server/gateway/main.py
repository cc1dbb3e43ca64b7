"""`python -m server serve` (the gateway alone) and `python -m server up` (engines + gateway).

`serve` puts the gateway in front of engines that already run: `--upstream NAME=URL` needs no
config file (repeat a NAME for replicas); with `--config`, a profile model's engines are
expected on its ports (base_port + i). `up` checks every profile against this host, builds the
tiny model if a profile asks for it, starts one supervised engine per replica, waits until all
are ready, then serves the gateway in front of them.

Shutdown (SIGINT or SIGTERM): /ready turns 503, the listening socket closes, in-flight requests
and streams get `limits.shutdown_grace` seconds to finish, then the engines `up` started are
stopped. A second SIGINT stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator

import uvicorn

from server.gateway.settings import GatewaySettings, SettingsError, load_settings, parse_upstreams
from server.engine.profiles import Profile

log = logging.getLogger("gateway")


class GatewayServer(uvicorn.Server):
    """uvicorn with our signal handling: mark the gateway as draining, never re-raise the signal
    after a graceful exit (the engines still have to be stopped), a second SIGINT forces exit."""

    def __init__(self, config: uvicorn.Config, state: object | None = None) -> None:
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
            self.gateway_state.draining = True  # type: ignore[attr-defined]
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            if not self.should_exit:
                log.info("shutting down: finishing in-flight requests (up to %g s)",
                         self.config.timeout_graceful_shutdown or 0)
            self.should_exit = True


def uvicorn_config(app: object, settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="uvloop", http="httptools", lifespan="on",
        backlog=2048, timeout_graceful_shutdown=settings.limits.shutdown_grace,  # type: ignore[arg-type]
        timeout_keep_alive=30, access_log=False, log_config=None, proxy_headers=False,
    )


async def serve_gateway(settings: GatewaySettings, profiles: dict[str, Profile]) -> None:
    from server.gateway.app import create_app

    app = create_app(settings, profiles=profiles)
    server = GatewayServer(uvicorn_config(app, settings), app.state.gateway)
    # Everything alive now (modules, FastAPI, pydantic schemas) lives as long as the process:
    # keep it out of the garbage collector's full passes, which otherwise stall every stream
    # for tens of milliseconds now and then.
    gc.collect()
    gc.freeze()
    models = ", ".join(f"{name} ({len(pool.engines)} engine{'s' * (len(pool.engines) != 1)})"
                       for name, pool in app.state.gateway.upstreams.models.items())
    log.info("gateway on http://%s:%d/v1 serving %s", settings.host, settings.port, models or "no models")
    await server.serve()


def _settings(args: argparse.Namespace) -> GatewaySettings:
    settings = load_settings(args.config) if args.config else GatewaySettings()
    upstreams = getattr(args, "upstream", None) or []
    if upstreams:
        settings.models = [*settings.models, *parse_upstreams(upstreams)]
    if args.host is not None:
        settings.host = args.host
    if args.port is not None:
        settings.port = args.port
    return settings


def _configure_logging(settings: GatewaySettings) -> None:
    from server.gateway.observability.logs import configure_logging

    configure_logging(settings.log_format)
    # httpx logs every request at INFO: noise, and real CPU on the hot path.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _run(coro: object) -> None:
    import uvloop

    uvloop.run(coro)  # type: ignore[arg-type]


def serve_command(args: argparse.Namespace) -> int:
    """The gateway only, in front of engines that already run."""
    try:
        settings = _settings(args)
        if not settings.models:
            raise SettingsError("no models: give --upstream NAME=URL or --config FILE")
        profiles = settings.load_profiles()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings)
    _run(serve_gateway(settings, profiles))
    return 0


async def _start_engines(settings: GatewaySettings, profiles: dict[str, Profile]) -> list:
    """One supervisor per replica of every profile model, started and ready; [] if interrupted."""
    from server.engine.supervisor import EngineSupervisor

    supervisors = []
    for model in settings.resolve_models(profiles):
        if model.profile is None:
            continue
        for url in model.urls:
            port = int(url.rsplit(":", 1)[1])
            supervisors.append(EngineSupervisor(model.profile, port=port, name=f"{model.name}:{port}"))
    if not supervisors:
        return supervisors
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for supervisor in supervisors:
            await supervisor.start()
        started = time.perf_counter()
        waits = {asyncio.ensure_future(s.wait_ready()): s for s in supervisors}
        stopper = asyncio.ensure_future(stop.wait())
        pending = set(waits)
        try:
            while pending:
                done, _ = await asyncio.wait({*pending, stopper}, timeout=10.0,
                                             return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    log.info("interrupted while engines were starting")
                    await _stop_engines(supervisors)
                    return []
                for task in done:
                    pending.discard(task)
                    supervisor = waits[task]
                    log.info("engine %s ready at %s in %.1f s", supervisor.name, supervisor.url,
                             task.result())  # raises EngineStartError if it could not start
                if pending:
                    log.info("waiting for engines: %d/%d ready after %.0f s", len(supervisors) - len(pending),
                             len(supervisors), time.perf_counter() - started)
        finally:
            stopper.cancel()
            for task in pending:
                task.cancel()
        return supervisors
    except BaseException:
        await _stop_engines(supervisors)
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _stop_engines(supervisors: list) -> None:
    if supervisors:
        log.info("stopping %d engine(s)", len(supervisors))
        await asyncio.gather(*(s.stop() for s in supervisors), return_exceptions=True)


async def _up(settings: GatewaySettings, profiles: dict[str, Profile]) -> int:
    from server.engine.supervisor import EngineStartError

    try:
        supervisors = await _start_engines(settings, profiles)
    except EngineStartError as exc:
        log.error("%s", exc)
        return 1
    if not supervisors and any(m.profile for m in settings.resolve_models(profiles)):
        return 130  # interrupted while starting
    try:
        await serve_gateway(settings, profiles)
    finally:
        await _stop_engines(supervisors)
    return 0


def up_command(args: argparse.Namespace) -> int:
    """Launch the engines of a gateway config, then serve the gateway in front of them."""
    from server.engine.supervisor import EngineStartError, prepare

    try:
        settings = _settings(args)
        profiles = settings.load_profiles()
        if not settings.models:
            raise SettingsError(f"{args.config}: no models")
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings)
    for name, profile in profiles.items():
        try:
            prepare(profile)  # refuses what this host cannot run; builds the tiny model if asked
        except EngineStartError as exc:
            print(f"error: model {name}: {exc}", file=sys.stderr)
            return 1
    code = 0

    async def main() -> None:
        nonlocal code
        code = await _up(settings, profiles)

    _run(main())
    return code
