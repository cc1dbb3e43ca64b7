"""Running on this host: `serve` (the gateway in front of running engines) and `up` (engines too).

Both read the config, plan the deployment with engines on this host (server.deploy.plan: a
profile's replicas on base_port, base_port+1, ...) and hand the gateway the plan's served models.
`serve` expects a profile model's engines on those ports; `--upstream NAME=URL` needs no config
(repeat a NAME for replicas). `up` checks every profile against this host, builds the tiny model
if a profile asks for it, starts one supervised engine per planned engine, waits until all are
ready (SIGINT or SIGTERM meanwhile stops them: exit 130), serves the gateway, and stops the
engines once the gateway has drained (server.gateway.serving).

Both serve with the config's `workers` gateway processes (1 by default), overridden by the
GATEWAY_WORKERS environment variable, itself overridden by `--workers`; "auto" is one per core.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from server.config import SettingsError, parse_upstreams
from server.deploy.plan import DeploymentPlan, plan_deployment
from server.engine.supervisor import EngineStartError, EngineSupervisor, prepare
from server.gateway.app.auth import load_admin_keys, load_api_keys, load_tenants
from server.gateway.app.hooks import load_hook
from server.gateway.conversations.store import check_store
from server.gateway.serving import configure_logging, run
from server.gateway.serving import serve as serve_gateway
from server.gateway.settings import GatewaySettings, load_settings, worker_count
from server.gateway.tenants.isolation import load_cache_salts

WORKERS_ENV = "GATEWAY_WORKERS"

log = logging.getLogger("gateway")


def serve(
    config: Path | None,
    upstreams: Sequence[str] = (),
    host: str | None = None,
    port: int | None = None,
    workers: str | None = None,
    app_hooks: Sequence[str] = (),
) -> int:
    """The gateway only, in front of engines that already run."""
    try:
        settings, plan = _load(config, upstreams, host, port, workers, app_hooks)
        if not settings.models:
            raise SettingsError("no models: give --upstream NAME=URL or --config FILE")
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    code: int = run(serve_gateway(settings, plan.served_models()))
    return code


def up(
    config: Path,
    host: str | None = None,
    port: int | None = None,
    workers: str | None = None,
    app_hooks: Sequence[str] = (),
) -> int:
    """Launch the engines of a config, then serve the gateway in front of them."""
    try:
        settings, plan = _load(config, (), host, port, workers, app_hooks)
        if not settings.models:
            raise SettingsError(f"{config}: no models")
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    for model in plan.models:
        if model.profile is not None and model.engines and model.profile.nodes > 1:
            print(f"error: model {model.name}: one engine spans {model.profile.nodes} nodes; `up` runs one host "
                  "(the Helm chart runs it as a LeaderWorkerSet)", file=sys.stderr)  # fmt: skip
            return 2
    profiles = {model.name: model.profile for model in plan.models if model.profile is not None}
    for name, profile in profiles.items():
        try:
            prepare(profile)  # refuses what this host cannot run; builds the tiny model if asked
        except EngineStartError as exc:
            print(f"error: model {name}: {exc}", file=sys.stderr)
            return 1
    code: int = run(_up(settings, plan))
    return code


def _load(
    config: Path | None,
    upstreams: Sequence[str],
    host: str | None,
    port: int | None,
    workers: str | None = None,
    app_hooks: Sequence[str] = (),
) -> tuple[GatewaySettings, DeploymentPlan]:
    settings = load_settings(config) if config else GatewaySettings()
    settings.app_hooks = [*settings.app_hooks, *app_hooks]
    for spec in settings.app_hooks:
        load_hook(spec)  # a hook that cannot be imported is refused before anything starts
    # Keys and tenants are read here too, so that a key source that is not there is refused once,
    # before anything starts (each worker reads them again in create_app).
    load_tenants(settings, admin_keys=load_admin_keys(settings.auth))
    load_cache_salts(settings)  # an isolated tenant's salt secret
    load_api_keys(settings.auth, base=settings.source.parent if settings.source else None)
    check_store(settings.responses_store, base=settings.source.parent if settings.source else None)  # refused once
    workers = workers or os.environ.get(WORKERS_ENV) or None
    if workers is not None:
        settings.workers = worker_count(workers)  # SettingsError for a bad value
    if upstreams:
        settings.models = [*settings.models, *parse_upstreams(upstreams)]
    if host is not None:
        settings.host = host
    if port is not None:
        settings.port = port
    return settings, plan_deployment(settings.models, config=config, placement="local")


async def _up(settings: GatewaySettings, plan: DeploymentPlan) -> int:
    try:
        supervisors = await _start_engines(plan)
    except EngineStartError as exc:
        log.error("%s", exc)
        return 1
    if not supervisors and plan.engines:
        return 130  # interrupted while starting
    try:
        code = await serve_gateway(settings, plan.served_models())
    finally:
        await _stop_engines(supervisors)
    return code


async def _start_engines(plan: DeploymentPlan) -> list[EngineSupervisor]:
    """One supervisor per planned engine, started and ready; [] if interrupted."""
    supervisors = [
        EngineSupervisor(e.profile, host=e.host, port=e.port, name=f"{e.model}:{e.port}") for e in plan.engines
    ]
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
                done, _ = await asyncio.wait({*pending, stopper}, timeout=10.0, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    log.info("interrupted while engines were starting")
                    await _stop_engines(supervisors)
                    return []
                for task in done:
                    pending.discard(task)
                    supervisor = waits[task]
                    log.info(
                        "engine %s ready at %s in %.1f s", supervisor.name, supervisor.url, task.result()
                    )  # raises EngineStartError if it could not start
                if pending:
                    log.info(
                        "waiting for engines: %d/%d ready after %.0f s",
                        len(supervisors) - len(pending),
                        len(supervisors),
                        time.perf_counter() - started,
                    )
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


async def _stop_engines(supervisors: list[EngineSupervisor]) -> None:
    if supervisors:
        log.info("stopping %d engine(s)", len(supervisors))
        await asyncio.gather(*(s.stop() for s in supervisors), return_exceptions=True)
