"""`python -m server compose`: the Docker Compose deployment, rendered from a gateway config.

One truth: the engines are the deployment plan's (server.deploy.plan, which `up` starts too) and
their command lines come from the profiles through `server.engine.render.engine_argv` (the
renderer `engine-args` and the supervisor use), so the compose file cannot drift from the
profiles without `--check` (and the tests) saying so. Next to the compose file this writes the
gateway's own config (the source config's settings, each model with its profile and the URLs of
its engine services) and the Prometheus config whose scrape targets are exactly the rendered
services: `docker/compose.yaml` -> `docker/gateway.yaml` + `docker/prometheus.yml`, and
`docker/compose.cpu.yaml` -> `docker/gateway.cpu.yaml` + `docker/prometheus.cpu.yml`.

This module assembles the file; each service is rendered by its own module: the engines
(server.deploy.engine_service), the gateway and its config (server.deploy.gateway_service), the
one-shot model downloads (server.deploy.downloads), Prometheus, Alertmanager and Grafana
(server.deploy.monitoring), with the images and paths they share in server.deploy.containers.
Each replica is its own service, `engine-<model>-<i>`, so the gateway routes across them and
Prometheus scrapes each; or, for an entry with a `dns` service name, all replicas are one scaled
service the gateway finds through Docker's DNS (server.deploy.scaled). Models named only by
`urls` (engines on other hosts) go to the gateway and Prometheus as they are.

Stopping drains: `docker compose down` (or stop, or a scale-in) sends SIGTERM and waits
`stop_grace_period` before SIGKILL. The gateway gets its `limits.shutdown_grace` plus a margin;
each engine runs with vLLM's `--shutdown-timeout` (in-flight requests finish, up to that long)
and gets that plus a margin. Compose stops the gateway before the engines it depends on.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.config import ModelEngines
from server.deploy import files
from server.deploy.containers import GATEWAY_PORT, HF_CACHE_VOLUME

# Re-exported: server.deploy.helm imports these from here (server.deploy.containers is their home).
from server.deploy.containers import HF_HOME as HF_HOME
from server.deploy.containers import START_PERIOD as START_PERIOD
from server.deploy.containers import TINY_MODEL_IN_IMAGE as TINY_MODEL_IN_IMAGE
from server.deploy.containers import VLLM_CPU_IMAGE as VLLM_CPU_IMAGE
from server.deploy.containers import VLLM_GPU_IMAGE as VLLM_GPU_IMAGE
from server.deploy.downloads import download_services
from server.deploy.engine_service import engine_service, scaled_engine_service
from server.deploy.errors import ComposeError
from server.deploy.gateway_service import (
    POSTGRES_SERVICE,
    REDIS_SERVICE,
    gateway_service,
    postgres_service,
    redis_service,
    render_gateway_config,
)
from server.deploy.monitoring import (
    alertmanager_config,
    monitoring_services,
    render_prometheus,
)
from server.deploy.plan import DeploymentPlan, plan_deployment
from server.deploy.scaled import ScaledService, ScaledServiceError, scaled_services
from server.deploy.secrets import LiteralKeys, SecretSources, secret_sources
from server.gateway.settings import load_settings

MONITORING_VOLUMES = ("prometheus-data", "alertmanager-data", "grafana-data")


def check_plan(plan: DeploymentPlan, compose_dir: Path) -> None:
    """Refuse what compose cannot run: no model at all, or a profile the gateway container cannot see.

    The compose file lives in `<checkout>/docker`, the profiles under `<checkout>/configs` (the
    folder the gateway container mounts).
    """
    configs = (compose_dir.parent / "configs").resolve()
    for model in plan.models:
        if model.profile is not None and model.profile.nodes > 1 and model.engines:
            raise ComposeError(
                f"{model.profile_path}: one engine spans {model.profile.nodes} nodes (data-parallel-size "
                f"{model.profile.data_parallel_size}, {model.profile.data_parallel_size_local} a node); compose runs "
                "one host: use the Helm chart (a LeaderWorkerSet), or give the model's `urls`"
            )
        if model.profile_path is not None and not model.profile_path.resolve().is_relative_to(configs):
            raise ComposeError(
                f"{model.profile_path}: the gateway container sees {configs} only; keep the profile under it"
            )
    if not any(model.urls or model.entry.dns for model in plan.models):
        raise ComposeError("the config names no model to serve")


def render_compose(
    plan: DeploymentPlan,
    *,
    project: str,
    compose_dir: Path,
    prometheus_file: str,
    gateway_file: str,
    scaled: list[ScaledService],
    shutdown_grace: float,
    secrets: SecretSources | None = None,
) -> dict[str, Any]:
    """The compose file as a mapping: services by name (compose starts them in `depends_on` order)."""
    engines = [*plan.engines, *(s.engine for s in scaled)]
    services: dict[str, Any] = download_services(
        engines, image=VLLM_GPU_IMAGE, hf_home=HF_HOME, cache_volume=HF_CACHE_VOLUME
    )
    for engine in plan.engines:
        services[engine.service] = engine_service(engine, compose_dir)
    for service in scaled:
        if service.name in services:
            raise ComposeError(f"model {service.engine.model!r}: dns names the service {service.name!r}, taken already")
        services[service.name] = scaled_engine_service(service, compose_dir)
    services["gateway"] = gateway_service(
        plan, gateway_file, scaled=scaled, shutdown_grace=shutdown_grace, secrets=secrets
    )
    if secrets is not None and secrets.redis_url_env:
        if REDIS_SERVICE in services:
            raise ComposeError(f"quota_store.backend redis: the service name {REDIS_SERVICE!r} is taken already")
        services[REDIS_SERVICE] = redis_service()
    if secrets is not None and secrets.database_url_env:
        if POSTGRES_SERVICE in services:
            raise ComposeError(f"responses_store.backend postgres: the service name {POSTGRES_SERVICE!r} is taken")
        services[POSTGRES_SERVICE] = postgres_service()
    services.update(monitoring_services(prometheus_file))
    return {
        "name": project,
        # In dclint's order (services-alphabetical-order): the order of a file is not its start order.
        "services": {name: _ordered(services[name]) for name in sorted(services)},
        "volumes": {
            name: {}
            for name in (
                "hf-cache",
                "vllm-cache",
                "gateway-data",
                *(["postgres-data"] if POSTGRES_SERVICE in services else []),
                *MONITORING_VOLUMES,
            )
        },
        "configs": {"alertmanager": {"content": files.dump(alertmanager_config())}},
    }


# The order dclint (service-keys-order) expects a service's keys in: these groups, then any other
# key in alphabetical order (deploy, ipc, pull_policy, stop_grace_period).
SERVICE_KEYS = (
    "image",
    "build",
    "depends_on",
    "volumes",
    "configs",
    "environment",
    "ports",
    "command",
    "entrypoint",
    "restart",
    "healthcheck",
)


def _ordered(service: dict[str, Any]) -> dict[str, Any]:
    rank = {key: (i, "") for i, key in enumerate(SERVICE_KEYS)}
    return dict(sorted(service.items(), key=lambda item: rank.get(item[0], (len(rank), item[0]))))


def companions(output: Path) -> tuple[Path, Path]:
    """The gateway and Prometheus configs beside a compose file.

    docker/compose.yaml -> docker/gateway.yaml, docker/prometheus.yml;
    docker/compose.cpu.yaml -> docker/gateway.cpu.yaml, docker/prometheus.cpu.yml.
    """
    variant = output.stem.removeprefix("compose")
    return output.with_name(f"gateway{variant}.yaml"), output.with_name(f"prometheus{variant}.yml")


def render_files(models: Sequence[ModelEngines], *, config: Path, output: Path) -> dict[Path, str]:
    """Every file this command owns for the `models` of the config file `config`, with its text."""
    compose_dir = output.resolve().parent
    plan = plan_deployment(models, config=config, placement="services")
    check_plan(plan, compose_dir)
    gateway_path, prometheus_path = companions(output)
    variant = output.stem.removeprefix("compose")
    project = "llm-serving" + variant.replace(".", "-")
    make = "make compose" + ("-" + variant.lstrip(".") if variant else "")
    header = files.header(config, make=make, command="compose")
    if plan.gpu_count:
        header += f"# NVIDIA GPUs needed on this host: {plan.gpu_count}.\n"
    settings = load_settings(config)
    try:
        secrets = secret_sources(settings, config, gateway_path.as_posix())
    except LiteralKeys as exc:
        raise ComposeError(str(exc)) from None
    taken = {engine.service for engine in plan.engines} | {"gateway", *monitoring_services(prometheus_path.name)}
    if secrets.redis_url_env:
        taken.add(REDIS_SERVICE)
    if secrets.database_url_env:
        taken.add(POSTGRES_SERVICE)
    try:
        scaled = scaled_services(plan, taken)
    except ScaledServiceError as exc:
        raise ComposeError(str(exc)) from None
    compose = render_compose(
        plan,
        project=project,
        compose_dir=compose_dir,
        prometheus_file=prometheus_path.name,
        gateway_file=gateway_path.name,
        scaled=scaled,
        shutdown_grace=settings.limits.shutdown_grace,
        secrets=secrets,
    )
    prometheus = render_prometheus(plan, gateway=f"gateway:{GATEWAY_PORT}", dns=dns_targets(plan))
    return {
        output: header + files.dump(compose),
        gateway_path: header + files.dump(render_gateway_config(plan, config, compose_dir)),
        prometheus_path: header + files.dump(prometheus),
    }


def dns_targets(plan: DeploymentPlan) -> list[tuple[str, str]]:
    """(model, dns target) for every `dns` name, scaled services of this file and names elsewhere."""
    return [(model.name, target) for model in plan.models for target in model.entry.dns]


def compose(models: Sequence[ModelEngines], *, config: Path, output: Path | None, check: bool) -> int:
    """`python -m server compose`: print, write (`output`) or `check` the rendered files."""
    target = output or Path("docker/compose.yaml")
    try:
        rendered = render_files(models, config=config, output=target)
    except ComposeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return files.emit(
        rendered, main=target, write=output is not None, check=check, regenerate="`make compose` / `make compose-cpu`"
    )
