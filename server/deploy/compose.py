"""`python -m server compose`: the Docker Compose deployment, rendered from a gateway config.

One truth: the engines are the deployment plan's (server.deploy.plan, which `up` starts too) and
their command lines come from the profiles through `server.engine.render.engine_argv` (the
renderer `engine-args` and the supervisor use), so the compose file cannot drift from the
profiles without `--check` (and the tests) saying so. Next to the compose file this writes the
gateway's own config (the source config's settings, each model with its profile and the URLs of
its engine services) and the Prometheus config whose scrape targets are exactly the rendered
services: `docker/compose.yaml` -> `docker/gateway.yaml` + `docker/prometheus.yml`, and
`docker/compose.cpu.yaml` -> `docker/gateway.cpu.yaml` + `docker/prometheus.cpu.yml`.

A profile with `device: gpu` runs in the official `vllm/vllm-openai` image with NVIDIA GPUs
reserved; a `device: cpu` profile runs in our vllm-cpu image (docker/Dockerfile.vllm-cpu), which
carries the tiny model. Each replica is its own service, `engine-<model>-<i>`, so the gateway
routes across them and Prometheus scrapes each; or, for an entry with a `dns` service name, all
replicas are one scaled service the gateway finds through Docker's DNS (server.deploy.scaled).
Models named only by `urls` (engines on other hosts) go to the gateway and Prometheus as they are.

Stopping drains: `docker compose down` (or stop, or a scale-in) sends SIGTERM and waits
`stop_grace_period` before SIGKILL. The gateway gets its `limits.shutdown_grace` plus a margin;
each engine runs with vLLM's `--shutdown-timeout` (in-flight requests finish, up to that long)
and gets that plus a margin. Compose stops the gateway before the engines it depends on.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.config import ModelEngines, read_mapping
from server.deploy import files
from server.deploy.downloads import download_services, engine_dependency
from server.deploy.monitoring import (
    alertmanager_config,
    monitoring_services,
    render_prometheus,
)
from server.deploy.plan import (
    DeploymentPlan,
    PlannedEngine,
    PlannedModel,
    plan_deployment,
)
from server.deploy.scaled import ScaledService, ScaledServiceError, scaled_services
from server.engine.planner import PlanError, parse_size, plan_profile
from server.engine.profiles import Profile
from server.engine.render import engine_argv
from server.gateway.settings import load_settings

# Images, pinned. The vLLM image tag follows the vLLM release the project is tested with.
VLLM_GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_CPU_IMAGE = "llm-serving/vllm-cpu:0.32.0"  # built from docker/Dockerfile.vllm-cpu
GATEWAY_IMAGE = "llm-serving/gateway:0.1.0"  # built from docker/Dockerfile.gateway

GATEWAY_PORT = 8000
# The gateway container sees the checkout's configs/ at /app/configs and its rendered config at
# /app/docker/gateway.yaml, so the profile paths in that config (../configs/profiles/...) resolve
# the same inside the container and in the checkout.
GATEWAY_CONFIG_IN_CONTAINER = "/app/docker/gateway.yaml"
CONFIGS_IN_CONTAINER = "/app/configs"
# The host address the gateway is published on: this host only, unless the operator publishes it
# (GATEWAY_BIND=0.0.0.0; `make up` does so when GATEWAY_API_KEYS is set, and refuses it without).
GATEWAY_BIND = "${GATEWAY_BIND:-127.0.0.1}"
# Where Docker/vLLM keep downloaded weights, shared by every engine through one volume (or a
# host folder named by HF_CACHE_DIR, e.g. an existing ~/.cache/huggingface).
HF_HOME = "/cache/huggingface"
HF_CACHE_VOLUME = "${HF_CACHE_DIR:-hf-cache}"
# vLLM's own cache (VLLM_CACHE_ROOT: torch.compile artefacts under torch_compile_cache/), on a
# volume so a recreated engine container loads its compiled graphs instead of compiling again.
VLLM_CACHE = "/cache/vllm"
# docker/Dockerfile.vllm-cpu builds the project's tiny model here at image build time.
TINY_MODEL_IN_IMAGE = "/models/tiny-llama"
# Local model folders other than the tiny model are bind-mounted read-only under this folder.
MODELS_IN_CONTAINER = "/models"

# Start-up grace before a failing /health counts: a GPU engine may first download 16 GB of
# weights; the CPU engine imports vLLM in about a minute on two cores.
START_PERIOD = {"gpu": "30m", "cpu": "10m"}

# vLLM's own drain (0.32: `--shutdown-timeout` seconds; its default, 0, aborts in-flight requests at
# SIGTERM): an engine being stopped lets its requests finish for this long, unless its profile sets
# `shutdown-timeout` itself. The Helm chart's engine pods get the same by default
# (engineTerminationGraceSeconds 60, minus 10). Docker waits the drain plus STOP_MARGIN_SECONDS
# before SIGKILL (its own default is 10 s), as it waits the gateway's shutdown_grace plus a margin.
ENGINE_DRAIN_SECONDS = 50
STOP_MARGIN_SECONDS = 10
GATEWAY_STOP_MARGIN_SECONDS = 5

# The one check both engine images can run: python is in both, curl in neither for sure.
HEALTH_PROBE = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)"


class ComposeError(ValueError):
    """A gateway config that cannot be turned into a compose deployment, with the reason."""


def check_plan(plan: DeploymentPlan, compose_dir: Path) -> None:
    """Refuse what compose cannot run: no model at all, or a profile the gateway container cannot see.

    The compose file lives in `<checkout>/docker`, the profiles under `<checkout>/configs` (the
    folder the gateway container mounts).
    """
    configs = (compose_dir.parent / "configs").resolve()
    for model in plan.models:
        if model.profile_path is not None and not model.profile_path.resolve().is_relative_to(configs):
            raise ComposeError(
                f"{model.profile_path}: the gateway container sees {configs} only; keep the profile under it"
            )
    if not any(model.urls or model.entry.dns for model in plan.models):
        raise ComposeError("the config names no model to serve")


def container_model(profile: Profile, compose_dir: Path) -> tuple[str | None, str | None]:
    """(model argument inside the container, bind mount for it) for a profile.

    A hub id is passed as it is (the engine downloads it into the shared cache). The tiny model
    is built into the CPU image. Any other local folder is mounted read-only, by a path relative
    to the compose file so the rendering does not depend on where the checkout lives.
    """
    path = profile.model_path
    if path is None:
        return None, None
    if profile.build_tiny_model:
        if profile.device != "cpu":
            raise ComposeError(
                f"{profile.name}: the tiny model is built into the CPU engine image only; use `device: cpu` for it"
            )
        return TINY_MODEL_IN_IMAGE, None
    inside = f"{MODELS_IN_CONTAINER}/{path.name}"
    source = Path(_relative(path, compose_dir))
    return inside, f"{source.as_posix()}:{inside}:ro"


def _relative(path: Path, start: Path) -> str:
    rel = os.path.relpath(path, start)
    return rel if rel.startswith(".") else f"./{rel}"


def engine_command(engine: PlannedEngine, compose_dir: Path) -> list[str]:
    """The container's arguments after the image's entrypoint: the one renderer's output, and the drain."""
    model, _ = container_model(engine.profile, compose_dir)
    argv = engine_argv(
        engine.profile,
        host="0.0.0.0",
        port=engine.port,
        launcher="image",
        model=model,
        kv_events_port=engine.kv_events_port,
    )
    if "shutdown-timeout" in engine.profile.vllm:  # rendered by engine_argv already
        return argv
    return [*argv, "--shutdown-timeout", str(ENGINE_DRAIN_SECONDS)]


def engine_drain_seconds(profile: Profile) -> int:
    """How long vLLM lets in-flight requests run after SIGTERM: the profile's `shutdown-timeout`, else ours."""
    value = profile.vllm.get("shutdown-timeout", ENGINE_DRAIN_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
        raise ComposeError(f"{profile.name}: vllm.shutdown-timeout must be whole seconds, got {value!r}")
    return int(value)


def gateway_command() -> list[str]:
    """`python -m server serve ...` arguments (after the image's `python -m server` entrypoint)."""
    return ["serve", "--config", GATEWAY_CONFIG_IN_CONTAINER, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


def render_gateway_config(plan: DeploymentPlan, config: Path, compose_dir: Path) -> dict[str, Any]:
    """The gateway's config inside compose: the operator's settings, the engines by URL.

    Every key the operator wrote is kept as written (timeouts, routing, auth...); `models`
    keeps each profile, for trimming and planned capacity, with `urls` naming its engine services.
    """
    configs = (compose_dir.parent / "configs").resolve()  # mounted into the gateway container
    models: list[dict[str, Any]] = []
    for model in plan.models:
        entry: dict[str, Any] = {"name": model.name}
        if model.entry.trimming is not None:
            entry["trimming"] = model.entry.trimming.model_dump()
        if model.profile_path is not None:
            entry["profile"] = f"../configs/{model.profile_path.resolve().relative_to(configs).as_posix()}"
        if model.entry.dns:  # engines found by DNS: a scaled service of this file, or elsewhere
            entry["dns"] = list(model.entry.dns)
        else:
            entry["urls"] = model.urls
        if (planned := planned_kv_tokens(model)) is not None:
            entry["planned_kv_tokens"] = planned
        if model.kv_events:  # precise prefix routing: each engine service's KV-event endpoint
            entry["kv_events"] = [model.kv_events.get(url, "") for url in model.urls]
        models.append(entry)
    rendered: dict[str, Any] = {"host": "0.0.0.0", "port": GATEWAY_PORT, "models": models}
    for key, value in read_mapping(config).items():
        if key not in rendered:
            rendered[key] = value
    return rendered


def planned_kv_tokens(model: PlannedModel) -> int | None:
    """The planner's KV-cache tokens for one engine of the model, computed here at render time.

    The gateway container can then show planned against actual capacity without the model's
    config.json (the CPU stack's tiny model is inside the engine image only) and without a GPU
    memory figure of its own: a GPU profile plans with the entry's `device_memory`. None when
    there is no profile, or a GPU profile without a figure.
    """
    if model.profile is None:
        return None
    try:
        memory = parse_size(model.entry.device_memory) if model.entry.device_memory else None
        return plan_profile(model.profile, memory).kv_cache_tokens
    except PlanError as exc:
        if model.profile.device == "gpu" and model.entry.device_memory is None:
            return None
        raise ComposeError(f"{model.name}: cannot plan its KV cache: {exc}") from None


def _healthcheck(port: int, start_period: str) -> dict[str, Any]:
    return {
        "test": ["CMD", "python3", "-c", HEALTH_PROBE.format(port=port)],
        "interval": "30s",
        "timeout": "10s",
        "retries": 3,
        "start_period": start_period,
        "start_interval": "10s",
    }


def engine_service(engine: PlannedEngine, compose_dir: Path) -> dict[str, Any]:
    profile = engine.profile
    drain = engine_drain_seconds(profile)
    environment: dict[str, str] = {"HF_TOKEN": "${HF_TOKEN:-}", "HF_HOME": HF_HOME, "VLLM_CACHE_ROOT": VLLM_CACHE}
    environment.update(profile.env)
    volumes = [f"{HF_CACHE_VOLUME}:{HF_HOME}", f"vllm-cache:{VLLM_CACHE}"]
    _, mount = container_model(profile, compose_dir)
    if mount:
        volumes.append(mount)
    service: dict[str, Any] = {}
    if profile.device == "gpu":
        service["image"] = VLLM_GPU_IMAGE
    else:
        service["image"] = VLLM_CPU_IMAGE
        service["build"] = {"context": "..", "dockerfile": "docker/Dockerfile.vllm-cpu"}
        service["pull_policy"] = "build"  # a local image: no registry has it
    service["command"] = engine_command(engine, compose_dir)
    service["environment"] = environment
    service["volumes"] = volumes
    # PyTorch's workers share tensors through /dev/shm; Docker's 64 MB default is far too small.
    service["ipc"] = "host"
    service["restart"] = "unless-stopped"
    service["healthcheck"] = _healthcheck(engine.port, START_PERIOD[profile.device])
    service["stop_grace_period"] = f"{drain + STOP_MARGIN_SECONDS}s"
    if dependency := engine_dependency(engine):
        service["depends_on"] = dependency
    if engine.gpus:
        service["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [
                        {"driver": "nvidia", "device_ids": [str(gpu) for gpu in engine.gpus], "capabilities": ["gpu"]}
                    ]
                }
            }
        }
    return service


def scaled_engine_service(scaled: ScaledService, compose_dir: Path) -> dict[str, Any]:
    """An engine service run `replicas` times behind its one name (server.deploy.scaled)."""
    service = engine_service(scaled.engine, compose_dir)
    service["deploy"] = {"replicas": scaled.replicas}
    return service


def gateway_service(
    plan: DeploymentPlan, gateway_file: str, *, scaled: list[ScaledService], shutdown_grace: float
) -> dict[str, Any]:
    service: dict[str, Any] = {
        "image": GATEWAY_IMAGE,
        "build": {"context": "..", "dockerfile": "docker/Dockerfile.gateway"},
        "pull_policy": "build",  # a local image: no registry has it
        "command": gateway_command(),
        # Comma-separated API keys clients must send, passed on only when the host sets it (the
        # gateway refuses to start on a variable that is set but empty).
        "environment": {"GATEWAY_API_KEYS": None},
        "volumes": [
            f"./{gateway_file}:{GATEWAY_CONFIG_IN_CONTAINER}:ro",
            f"../configs:{CONFIGS_IN_CONTAINER}:ro",
        ],
        "ports": [{"target": GATEWAY_PORT, "published": str(GATEWAY_PORT), "host_ip": GATEWAY_BIND}],
        "restart": "unless-stopped",
        # In-flight streams finish on `docker compose down` (the gateway's drain), then SIGKILL.
        "stop_grace_period": f"{math.ceil(shutdown_grace) + GATEWAY_STOP_MARGIN_SECONDS}s",
    }
    engines = sorted([engine.service for engine in plan.engines] + [s.name for s in scaled])
    if engines:
        # Started, not healthy: the gateway health-checks its engines itself (/ready), so it and
        # its metrics are up while an engine loads, and one engine that never loads stops nothing.
        service["depends_on"] = {name: {"condition": "service_started"} for name in engines}
    return service


def render_compose(
    plan: DeploymentPlan,
    *,
    project: str,
    compose_dir: Path,
    prometheus_file: str,
    gateway_file: str,
    scaled: list[ScaledService],
    shutdown_grace: float,
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
    services["gateway"] = gateway_service(plan, gateway_file, scaled=scaled, shutdown_grace=shutdown_grace)
    services.update(monitoring_services(prometheus_file))
    return {
        "name": project,
        # In dclint's order (services-alphabetical-order): the order of a file is not its start order.
        "services": {name: _ordered(services[name]) for name in sorted(services)},
        "volumes": {
            name: {} for name in ("hf-cache", "vllm-cache", "prometheus-data", "alertmanager-data", "grafana-data")
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
    taken = {engine.service for engine in plan.engines} | {"gateway", *monitoring_services(prometheus_path.name)}
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
        shutdown_grace=load_settings(config).limits.shutdown_grace,
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
