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
routes across them and Prometheus scrapes each. Models named only by `urls` (engines on other
hosts) go to the gateway and Prometheus as they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.config import ModelEngines, read_mapping
from server.deploy import files
from server.deploy.plan import (
    SERVICE_PORT,
    DeploymentPlan,
    PlannedEngine,
    plan_deployment,
)
from server.engine.profiles import Profile
from server.engine.render import engine_argv

# Images, pinned. The vLLM image tag follows the vLLM release the project is tested with.
VLLM_GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_CPU_IMAGE = "llm-serving/vllm-cpu:0.32.0"  # built from docker/Dockerfile.vllm-cpu
GATEWAY_IMAGE = "llm-serving/gateway:0.1.0"  # built from docker/Dockerfile.gateway
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"

ENGINE_PORT = SERVICE_PORT  # inside each engine container
GATEWAY_PORT = 8000
# The gateway container sees the checkout's configs/ at /app/configs and its rendered config at
# /app/docker/gateway.yaml, so the profile paths in that config (../configs/profiles/...) resolve
# the same inside the container and in the checkout.
GATEWAY_CONFIG_IN_CONTAINER = "/app/docker/gateway.yaml"
CONFIGS_IN_CONTAINER = "/app/configs"
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000
# Where Docker/vLLM keep downloaded weights, shared by every engine through one volume (or a
# host folder named by HF_CACHE_DIR, e.g. an existing ~/.cache/huggingface).
HF_HOME = "/cache/huggingface"
# docker/Dockerfile.vllm-cpu builds the project's tiny model here at image build time.
TINY_MODEL_IN_IMAGE = "/models/tiny-llama"
# Local model folders other than the tiny model are bind-mounted read-only under this folder.
MODELS_IN_CONTAINER = "/models"

SCRAPE_INTERVAL = "10s"
RULES_IN_CONTAINER = "/etc/prometheus/alerts.yml"  # docker/prometheus/alerts.yml (METRICS)

# Start-up grace before a failing /health counts: a GPU engine may first download 16 GB of
# weights; the CPU engine imports vLLM in about a minute on two cores.
START_PERIOD = {"gpu": "30m", "cpu": "10m"}

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
            raise ComposeError(f"{model.profile_path}: the gateway container sees {configs} only; "
                               "keep the profile under it")
    if not any(model.urls for model in plan.models):
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
                f"{profile.name}: the tiny model is built into the CPU engine image only; "
                "use `device: cpu` for it"
            )
        return TINY_MODEL_IN_IMAGE, None
    inside = f"{MODELS_IN_CONTAINER}/{path.name}"
    source = Path(_relative(path, compose_dir))
    return inside, f"{source.as_posix()}:{inside}:ro"


def _relative(path: Path, start: Path) -> str:
    rel = os.path.relpath(path, start)
    return rel if rel.startswith(".") else f"./{rel}"


def engine_command(engine: PlannedEngine, compose_dir: Path) -> list[str]:
    """The container's arguments after the image's entrypoint: the one renderer's output."""
    model, _ = container_model(engine.profile, compose_dir)
    return engine_argv(engine.profile, host="0.0.0.0", port=ENGINE_PORT, launcher="image",
                       model=model)


def gateway_command() -> list[str]:
    """`python -m server serve ...` arguments (after the image's `python -m server` entrypoint)."""
    return ["serve", "--config", GATEWAY_CONFIG_IN_CONTAINER,
            "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


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
        entry["urls"] = model.urls
        models.append(entry)
    rendered: dict[str, Any] = {"host": "0.0.0.0", "port": GATEWAY_PORT, "models": models}
    for key, value in read_mapping(config).items():
        if key not in rendered:
            rendered[key] = value
    return rendered


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
    environment: dict[str, str] = {"HF_TOKEN": "${HF_TOKEN:-}", "HF_HOME": HF_HOME}
    environment.update(profile.env)
    volumes = [f"${{HF_CACHE_DIR:-hf-cache}}:{HF_HOME}"]
    _, mount = container_model(profile, compose_dir)
    if mount:
        volumes.append(mount)
    service: dict[str, Any] = {}
    if profile.device == "gpu":
        service["image"] = VLLM_GPU_IMAGE
    else:
        service["image"] = VLLM_CPU_IMAGE
        service["build"] = {"context": "..", "dockerfile": "docker/Dockerfile.vllm-cpu"}
    service["command"] = engine_command(engine, compose_dir)
    service["environment"] = environment
    service["volumes"] = volumes
    # PyTorch's workers share tensors through /dev/shm; Docker's 64 MB default is far too small.
    service["ipc"] = "host"
    service["restart"] = "unless-stopped"
    service["healthcheck"] = _healthcheck(ENGINE_PORT, START_PERIOD[profile.device])
    if engine.gpus:
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(gpu) for gpu in engine.gpus], "capabilities": ["gpu"]}
        ]}}}
    return service


def gateway_service(plan: DeploymentPlan, gateway_file: str) -> dict[str, Any]:
    service: dict[str, Any] = {
        "image": GATEWAY_IMAGE,
        "build": {"context": "..", "dockerfile": "docker/Dockerfile.gateway"},
        "command": gateway_command(),
        # Comma-separated API keys clients must send; empty leaves the gateway open.
        "environment": {"GATEWAY_API_KEYS": "${GATEWAY_API_KEYS:-}"},
        "volumes": [
            f"./{gateway_file}:{GATEWAY_CONFIG_IN_CONTAINER}:ro",
            f"../configs:{CONFIGS_IN_CONTAINER}:ro",
        ],
        "ports": [f"{GATEWAY_PORT}:{GATEWAY_PORT}"],
        "restart": "unless-stopped",
    }
    if plan.engines:
        service["depends_on"] = {
            engine.service: {"condition": "service_healthy"} for engine in plan.engines
        }
    return service


def prometheus_service(prometheus_file: str) -> dict[str, Any]:
    return {
        "image": PROMETHEUS_IMAGE,
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            "--storage.tsdb.retention.time=15d",
        ],
        "volumes": [
            f"./{prometheus_file}:/etc/prometheus/prometheus.yml:ro",
            f"./prometheus/alerts.yml:{RULES_IN_CONTAINER}:ro",
            "prometheus-data:/prometheus",
        ],
        # No login on Prometheus: reachable from this host only (ssh -L 9090:localhost:9090).
        "ports": [f"127.0.0.1:{PROMETHEUS_PORT}:{PROMETHEUS_PORT}"],
        "restart": "unless-stopped",
        "depends_on": {"gateway": {"condition": "service_started"}},
    }


def grafana_service() -> dict[str, Any]:
    return {
        "image": GRAFANA_IMAGE,
        "environment": {
            "GF_SECURITY_ADMIN_USER": "admin",
            # No default password: compose refuses to start without one.
            "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}",
            "GF_USERS_ALLOW_SIGN_UP": "false",
        },
        "volumes": [
            "./grafana/provisioning:/etc/grafana/provisioning:ro",
            "./grafana/dashboards:/var/lib/grafana/dashboards:ro",
            "grafana-data:/var/lib/grafana",
        ],
        "ports": [f"{GRAFANA_PORT}:{GRAFANA_PORT}"],
        "restart": "unless-stopped",
        "depends_on": {"prometheus": {"condition": "service_started"}},
    }


def render_compose(plan: DeploymentPlan, *, project: str, compose_dir: Path,
                   prometheus_file: str, gateway_file: str) -> dict[str, Any]:
    """The compose file as a mapping (services in start order: engines, gateway, monitoring)."""
    services: dict[str, Any] = {}
    for engine in plan.engines:
        services[engine.service] = engine_service(engine, compose_dir)
    services["gateway"] = gateway_service(plan, gateway_file)
    services["prometheus"] = prometheus_service(prometheus_file)
    services["grafana"] = grafana_service()
    return {
        "name": project,
        "services": services,
        "volumes": {"hf-cache": {}, "prometheus-data": {}, "grafana-data": {}},
    }


def render_prometheus(plan: DeploymentPlan) -> dict[str, Any]:
    """Prometheus config: the gateway, and every engine (containers and remote URLs) by model."""
    upstreams = [(engine.model, engine.url) for engine in plan.engines]
    upstreams += [(model.name, url) for model in plan.models for url in model.remote]
    by_model: dict[str, list[str]] = {}
    for model, url in upstreams:
        by_model.setdefault(model, []).append(_host_port(url))
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [RULES_IN_CONTAINER],
        "scrape_configs": [
            {"job_name": "gateway",
             "static_configs": [{"targets": [f"gateway:{GATEWAY_PORT}"]}]},
            {"job_name": "vllm",
             "static_configs": [{"targets": targets, "labels": {"model": model}}
                                for model, targets in by_model.items()]},
        ],
    }


def _host_port(url: str) -> str:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if ":" not in rest:
        rest += ":443" if url.startswith("https://") else ":80"
    return rest


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
    compose = render_compose(plan, project=project, compose_dir=compose_dir,
                             prometheus_file=prometheus_path.name, gateway_file=gateway_path.name)
    return {
        output: header + files.dump(compose),
        gateway_path: header + files.dump(render_gateway_config(plan, config, compose_dir)),
        prometheus_path: header + files.dump(render_prometheus(plan)),
    }


def compose(models: Sequence[ModelEngines], *, config: Path, output: Path | None, check: bool) -> int:
    """`python -m server compose`: print, write (`output`) or `check` the rendered files."""
    target = output or Path("docker/compose.yaml")
    try:
        rendered = render_files(models, config=config, output=target)
    except ComposeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return files.emit(rendered, main=target, write=output is not None, check=check,
                      regenerate="`make compose` / `make compose-cpu`")
