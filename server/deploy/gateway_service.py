"""The gateway in the compose file: its service, and the config it reads (docker/gateway*.yaml).

The config is the source config's settings as the operator wrote them, with each model's profile
(for trimming), the URLs (or `dns` names) of its engine services and the planner's KV-cache
tokens, so the container shows planned against actual capacity without a model or GPU of its
own. The service publishes the gateway on this host only unless GATEWAY_BIND says otherwise,
starts after its engines (started, not healthy: the gateway checks its engines itself) and gets
its `limits.shutdown_grace` plus a margin to drain on `docker compose down`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from server.config import read_mapping
from server.deploy.containers import (
    CONFIGS_IN_CONTAINER,
    GATEWAY_BIND,
    GATEWAY_CONFIG_IN_CONTAINER,
    GATEWAY_IMAGE,
    GATEWAY_PORT,
    GATEWAY_STOP_MARGIN_SECONDS,
)
from server.deploy.errors import ComposeError
from server.deploy.plan import DeploymentPlan, PlannedModel
from server.deploy.scaled import ScaledService
from server.engine.planner import PlanError, parse_size, plan_profile


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


def gateway_service(
    plan: DeploymentPlan, gateway_file: str, *, scaled: list[ScaledService], shutdown_grace: float
) -> dict[str, Any]:
    """The gateway's service: the gateway image serving `gateway_file`, after every engine service."""
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
