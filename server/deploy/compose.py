"""`python -m server compose`: the Docker Compose deployment, rendered from a gateway config.

One truth: the engines' command lines come from the profiles through `server.engine.render.engine_argv`
(the renderer `engine-args` and the supervisor use), so the compose file cannot drift from the
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

import argparse
import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from server.gateway.settings import GatewaySettings, SettingsError, load_settings
from server.engine.profiles import Profile, load_profile
from server.engine.render import engine_argv

# Images, pinned. The vLLM image tag follows the vLLM release the project is tested with.
VLLM_GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
VLLM_CPU_IMAGE = "llm-serving/vllm-cpu:0.32.0"  # built from docker/Dockerfile.vllm-cpu
GATEWAY_IMAGE = "llm-serving/gateway:0.1.0"  # built from docker/Dockerfile.gateway
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
GRAFANA_IMAGE = "grafana/grafana:12.1.1"

ENGINE_PORT = 8000  # inside each engine container
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

HEADER = """\
# Generated from {config} by `{make}` (python -m server compose).
# Do not edit by hand: change the profiles or {config} and regenerate;
# `make test` fails while this file differs from a fresh rendering.
"""


class ComposeError(ValueError):
    """A gateway config that cannot be turned into a compose deployment, with the reason."""


@dataclass(frozen=True)
class Engine:
    """One engine container: one replica of one profile."""

    service: str
    model: str  # the served model name the gateway routes by
    profile: Profile
    replica: int
    gpus: tuple[str, ...] = ()  # NVIDIA device ids reserved for it (GPU profiles)

    @property
    def device(self) -> str:
        return self.profile.device

    @property
    def url(self) -> str:
        return f"http://{self.service}:{ENGINE_PORT}"


@dataclass
class Deployment:
    """What runs: engine containers, plus engines elsewhere named by URL, per served model."""

    engines: list[Engine] = field(default_factory=list)
    remote: dict[str, list[str]] = field(default_factory=dict)  # model -> URLs of other hosts
    # The gateway config's `models`, each with its profile (relative to the compose folder) and
    # the URLs of all its engines.
    gateway_models: list[dict[str, Any]] = field(default_factory=list)

    def upstreams(self) -> list[tuple[str, str]]:
        """(model, URL) for every engine the gateway is to use, in config order."""
        pairs = [(engine.model, engine.url) for engine in self.engines]
        for model, urls in self.remote.items():
            pairs += [(model, url) for url in urls]
        return pairs

    @property
    def gpu_count(self) -> int:
        return sum(len(engine.gpus) for engine in self.engines)


def service_name(model: str, replica: int) -> str:
    """`engine-<model>-<i>`, with the model name cut down to what a DNS label allows."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"engine-{slug}-{replica}"


def plan_deployment(settings: GatewaySettings, compose_dir: Path) -> Deployment:
    """Expand the config's models into engine replicas, giving each GPU replica its own GPUs.

    Docker's `count: N` always hands out the first N GPUs, so two replicas would share GPU 0;
    explicit `device_ids` in order (replica 0 of the first model gets 0..tp*pp-1, and so on)
    give each its own. The compose file lives in `<checkout>/docker`, the profiles under
    `<checkout>/configs` (the folder the gateway container mounts).
    """
    deployment = Deployment()
    next_gpu = 0
    seen: set[str] = set()
    configs = (compose_dir.parent / "configs").resolve()  # mounted into the gateway container
    for entry in settings.models:
        path = settings.profile_path(entry)
        remote = [url.rstrip("/") for url in entry.urls]
        gateway_entry: dict[str, Any] = {"name": entry.name}
        deployment.gateway_models.append(gateway_entry)
        if entry.trimming is not None:
            gateway_entry["trimming"] = entry.trimming.model_dump()
        if path is None:
            deployment.remote.setdefault(entry.name or "", []).extend(remote)
            gateway_entry["urls"] = remote
            continue
        if not path.resolve().is_relative_to(configs):
            raise ComposeError(f"{path}: the gateway container sees {configs} only; "
                               "keep the profile under it")
        profile = load_profile(path)
        model = entry.name or profile.served_model_name
        gateway_entry["name"] = model
        gateway_entry["profile"] = f"../configs/{path.resolve().relative_to(configs).as_posix()}"
        if remote:
            deployment.remote.setdefault(model, []).extend(remote)
        first = len(deployment.engines)
        for replica in range(profile.replicas):
            name = service_name(model, replica)
            if name in seen:
                raise ComposeError(f"two models render to the service name {name!r}; rename one")
            seen.add(name)
            gpus: tuple[str, ...] = ()
            if profile.device == "gpu":
                width = profile.tensor_parallel_size * profile.pipeline_parallel_size
                gpus = tuple(str(i) for i in range(next_gpu, next_gpu + width))
                next_gpu += width
            deployment.engines.append(Engine(name, model, profile, replica, gpus))
        gateway_entry["urls"] = [e.url for e in deployment.engines[first:]] + remote
    if not deployment.upstreams():
        raise ComposeError("the config names no model to serve")
    return deployment


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


def engine_command(engine: Engine, compose_dir: Path) -> list[str]:
    """The container's arguments after the image's entrypoint: the one renderer's output."""
    model, _ = container_model(engine.profile, compose_dir)
    return engine_argv(engine.profile, host="0.0.0.0", port=ENGINE_PORT, launcher="image",
                       model=model)


def gateway_command() -> list[str]:
    """`python -m server serve ...` arguments (after the image's `python -m server` entrypoint)."""
    return ["serve", "--config", GATEWAY_CONFIG_IN_CONTAINER,
            "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


def render_gateway_config(settings: GatewaySettings, deployment: Deployment) -> dict[str, Any]:
    """The gateway's config inside compose: the operator's settings, the engines by URL.

    Every key the operator wrote is kept as written (timeouts, routing, auth...); `models`
    keeps each profile, for trimming and planned capacity, with `urls` naming its engine services.
    """
    source = yaml.safe_load(settings.source.read_text()) if settings.source else {}
    config: dict[str, Any] = {"host": "0.0.0.0", "port": GATEWAY_PORT,
                              "models": deployment.gateway_models}
    for key, value in (source or {}).items():
        if key not in config:
            config[key] = value
    return config


def _healthcheck(port: int, start_period: str) -> dict[str, Any]:
    return {
        "test": ["CMD", "python3", "-c", HEALTH_PROBE.format(port=port)],
        "interval": "30s",
        "timeout": "10s",
        "retries": 3,
        "start_period": start_period,
        "start_interval": "10s",
    }


def engine_service(engine: Engine, compose_dir: Path) -> dict[str, Any]:
    profile = engine.profile
    environment: dict[str, str] = {"HF_TOKEN": "${HF_TOKEN:-}", "HF_HOME": HF_HOME}
    environment.update(profile.env)
    volumes = [f"${{HF_CACHE_DIR:-hf-cache}}:{HF_HOME}"]
    _, mount = container_model(profile, compose_dir)
    if mount:
        volumes.append(mount)
    service: dict[str, Any] = {}
    if engine.device == "gpu":
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
    service["healthcheck"] = _healthcheck(ENGINE_PORT, START_PERIOD[engine.device])
    if engine.gpus:
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": list(engine.gpus), "capabilities": ["gpu"]}
        ]}}}
    return service


def gateway_service(deployment: Deployment, gateway_file: str) -> dict[str, Any]:
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
    if deployment.engines:
        service["depends_on"] = {
            engine.service: {"condition": "service_healthy"} for engine in deployment.engines
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


def render_compose(deployment: Deployment, *, project: str, compose_dir: Path,
                   prometheus_file: str, gateway_file: str) -> dict[str, Any]:
    """The compose file as a mapping (services in start order: engines, gateway, monitoring)."""
    services: dict[str, Any] = {}
    for engine in deployment.engines:
        services[engine.service] = engine_service(engine, compose_dir)
    services["gateway"] = gateway_service(deployment, gateway_file)
    services["prometheus"] = prometheus_service(prometheus_file)
    services["grafana"] = grafana_service()
    return {
        "name": project,
        "services": services,
        "volumes": {"hf-cache": {}, "prometheus-data": {}, "grafana-data": {}},
    }


def render_prometheus(deployment: Deployment) -> dict[str, Any]:
    """Prometheus config: the gateway, and every engine (containers and remote URLs) by model."""
    by_model: dict[str, list[str]] = {}
    for model, url in deployment.upstreams():
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


def render_files(config: Path, output: Path) -> dict[Path, str]:
    """Every file this command owns for one config, with its text."""
    try:
        settings = load_settings(config)
    except SettingsError as exc:
        raise ComposeError(str(exc)) from None
    compose_dir = output.resolve().parent
    deployment = plan_deployment(settings, compose_dir)
    gateway_path, prometheus_path = companions(output)
    variant = output.stem.removeprefix("compose")
    project = "llm-serving" + variant.replace(".", "-")
    make = "make compose" + ("-" + variant.lstrip(".") if variant else "")
    header = HEADER.format(config=_display_path(config), make=make)
    if deployment.gpu_count:
        header += f"# NVIDIA GPUs needed on this host: {deployment.gpu_count}.\n"
    compose = render_compose(deployment, project=project, compose_dir=compose_dir,
                             prometheus_file=prometheus_path.name, gateway_file=gateway_path.name)
    return {
        output: header + _dump(compose),
        gateway_path: header + _dump(render_gateway_config(settings, deployment)),
        prometheus_path: header + _dump(render_prometheus(deployment)),
    }


def _display_path(path: Path) -> str:
    """A path as written in the header: relative to the checkout, so renderings match anywhere."""
    root = Path(__file__).resolve().parents[2]
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def _dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def main(args: argparse.Namespace) -> int:
    config = Path(args.config)
    output = Path(args.output) if args.output else Path("docker/compose.yaml")
    try:
        files = render_files(config, output)
    except ComposeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        return _check(files)
    if not args.output:
        sys.stdout.write(files[output])
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _check(files: dict[Path, str]) -> int:
    drift = False
    for path, text in files.items():
        current = path.read_text() if path.exists() else ""
        if current != text:
            drift = True
            sys.stderr.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (fresh rendering)"))
    if drift:
        print("error: out of date; run `make compose` / `make compose-cpu` and commit",
              file=sys.stderr)
        return 1
    return 0
