"""The gateway in the compose file: its service, and the config it reads (docker/gateway*.yaml).

The config is the source config's settings as the operator wrote them, with each model's profile
(for trimming), the URLs (or `dns` names) of its engine services and the planner's KV-cache
tokens, so the container shows planned against actual capacity without a model or GPU of its
own. The service publishes the gateway on this host only unless GATEWAY_BIND says otherwise,
starts after its engines (started, not healthy: the gateway checks its engines itself) and gets
its `limits.shutdown_grace` plus a margin to drain on `docker compose down`.

Tenants' keys and the gateway's secrets never enter the rendered files (server.deploy.secrets):
the service passes their variables through from the host, a tenant's `api_keys_file` is rewritten
to the same file under the mounted configs/, and `quota_store.backend: redis` adds a `redis`
service the gateway's $GATEWAY_REDIS_URL points at unless the host names a Redis of its own.
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
from server.deploy.secrets import SecretSources
from server.engine.planner import PlanError, parse_size, plan_profile


def gateway_command() -> list[str]:
    """`python -m server serve ...` arguments (after the image's `python -m server` entrypoint)."""
    return ["serve", "--config", GATEWAY_CONFIG_IN_CONTAINER, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


REDIS_IMAGE = "redis:7.4.2-alpine"  # pinned; quota counters only: nothing persisted
REDIS_SERVICE = "redis"
REDIS_URL = f"redis://{REDIS_SERVICE}:6379/0"
# responses_store.backend postgres: one PostgreSQL for the stored Responses, its password from the
# host's variable (never in the file); the gateway's URL defaults to it.
POSTGRES_IMAGE = "postgres:16.6-alpine"
POSTGRES_SERVICE = "postgres"
POSTGRES_PASSWORD_ENV = "GATEWAY_POSTGRES_PASSWORD"
POSTGRES_URL = f"postgresql://gateway:${{{POSTGRES_PASSWORD_ENV}}}@{POSTGRES_SERVICE}:5432/gateway"


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
    if isinstance(rendered.get("tenants"), list):
        rendered["tenants"] = [_tenant_in_container(t, i, config, configs) for i, t in enumerate(rendered["tenants"])]
    return rendered


def _tenant_in_container(tenant: Any, index: int, config: Path, configs: Path) -> Any:
    """A tenant as the gateway container reads it: its `api_keys_file` as a path under the mounted
    configs/ (relative to docker/gateway.yaml, as the profiles are); refused when outside it."""
    if not isinstance(tenant, dict) or not isinstance(tenant.get("api_keys_file"), str):
        return tenant
    written = Path(tenant["api_keys_file"])
    found = (written if written.is_absolute() else config.parent / written).resolve()
    if not found.is_relative_to(configs):
        raise ComposeError(
            f"{config}: tenants.{index} ({tenant.get('name')}).api_keys_file: {found} is outside {configs}, "
            "the only folder the gateway container mounts; keep key files under it (and out of git), "
            "or name a variable (api_keys_env)"
        )
    return {**tenant, "api_keys_file": f"../configs/{found.relative_to(configs).as_posix()}"}


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
    plan: DeploymentPlan,
    gateway_file: str,
    *,
    scaled: list[ScaledService],
    shutdown_grace: float,
    secrets: SecretSources | None = None,
) -> dict[str, Any]:
    """The gateway's service: the gateway image serving `gateway_file`, after every engine service."""
    service: dict[str, Any] = {
        "image": GATEWAY_IMAGE,
        "build": {"context": "..", "dockerfile": "docker/Dockerfile.gateway"},
        "pull_policy": "build",  # a local image: no registry has it
        "command": gateway_command(),
        # Comma-separated API keys clients must send, passed on only when the host sets it (the
        # gateway refuses to start on a variable that is set but empty); with tenants, their keys.
        "environment": _secret_environment(secrets),
        "volumes": [
            f"./{gateway_file}:{GATEWAY_CONFIG_IN_CONTAINER}:ro",
            f"../configs:{CONFIGS_IN_CONTAINER}:ro",
            "gateway-data:/data",  # the response store's SQLite file (GATEWAY_DATA_DIR, the image's)
        ],
        "ports": [{"target": GATEWAY_PORT, "published": str(GATEWAY_PORT), "host_ip": GATEWAY_BIND}],
        "restart": "unless-stopped",
        # In-flight streams finish on `docker compose down` (the gateway's drain), then SIGKILL.
        "stop_grace_period": f"{math.ceil(shutdown_grace) + GATEWAY_STOP_MARGIN_SECONDS}s",
    }
    engines = sorted([engine.service for engine in plan.engines] + [s.name for s in scaled])
    depends: dict[str, Any] = {}
    if secrets is not None and secrets.redis_url_env:
        # The quota store must answer before the gateway admits a tenant's first request.
        depends[REDIS_SERVICE] = {"condition": "service_healthy"}
    if secrets is not None and secrets.database_url_env:
        # The response store is opened (and migrated) at start: the gateway refuses to start without it.
        depends[POSTGRES_SERVICE] = {"condition": "service_healthy"}
    # Started, not healthy: the gateway health-checks its engines itself (/ready), so it and
    # its metrics are up while an engine loads, and one engine that never loads stops nothing.
    depends.update({name: {"condition": "service_started"} for name in engines})
    if depends:
        service["depends_on"] = dict(sorted(depends.items()))
    return service


def _secret_environment(secrets: SecretSources | None) -> dict[str, str | None]:
    """The gateway's variables from the host, by name only (None: passed on when the host sets it);
    the Redis URL defaults to this file's `redis` service."""
    if secrets is None:
        return {"GATEWAY_API_KEYS": None}
    env: dict[str, str | None] = {} if secrets.tenants else {"GATEWAY_API_KEYS": None}
    env.update({name: None for name in [*secrets.optional, *secrets.variables]})
    if secrets.redis_url_env:
        env[secrets.redis_url_env] = f"${{{secrets.redis_url_env}:-{REDIS_URL}}}"
    if secrets.database_url_env:
        env[secrets.database_url_env] = f"${{{secrets.database_url_env}:-{POSTGRES_URL}}}"
    return env


def postgres_service() -> dict[str, Any]:
    """The response store of `responses_store.backend: postgres`: one PostgreSQL on a volume; its
    password from the host (compose refuses to start without it)."""
    return {
        "image": POSTGRES_IMAGE,
        "environment": {
            "POSTGRES_USER": "gateway",
            "POSTGRES_DB": "gateway",
            "POSTGRES_PASSWORD": f"${{{POSTGRES_PASSWORD_ENV}:?set {POSTGRES_PASSWORD_ENV} (URL-safe characters)}}",
        },
        "volumes": ["postgres-data:/var/lib/postgresql/data"],
        "restart": "unless-stopped",
        "healthcheck": {
            "test": ["CMD", "pg_isready", "-U", "gateway", "-d", "gateway"],
            "interval": "5s",
            "timeout": "3s",
            "retries": 20,
        },
    }


def redis_service() -> dict[str, Any]:
    """The quota store of `quota_store.backend: redis`: one Redis, counters in memory only."""
    return {
        "image": REDIS_IMAGE,
        "command": ["redis-server", "--save", "", "--appendonly", "no"],
        "restart": "unless-stopped",
        "healthcheck": {
            "test": ["CMD", "redis-cli", "ping"],
            "interval": "5s",
            "timeout": "3s",
            "retries": 10,
        },
    }
