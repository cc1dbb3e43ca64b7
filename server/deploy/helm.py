"""`python -m server helm-values`: the Helm chart's values, rendered from a gateway config.

The chart (charts/llm-serving) holds the Kubernetes objects; what runs comes from here, out of
the same deployment plan and engine renderer as `up` and compose: one engine Deployment per
profile model (its vLLM arguments from `server.engine.render.engine_argv`, its GPUs a pod
tensor x pipeline x local data parallel), or for an engine over several nodes a LeaderWorkerSet
of `nodes` pods a group (vLLM's own multi-node data parallel: `server.engine.render.node_flags`),
and the gateway's models, each pointing at its engines' Service (for a LeaderWorkerSet, the
group leaders') or at the URLs the config names. The operator's other gateway settings
(timeouts, routing, auth, ...) go into the gateway's ConfigMap as written, keys excepted
(server.deploy.secrets): a config that writes keys is refused, a tenant's `api_keys_file` becomes
the file of that name in the mounted `gateway.keysSecret`, and the header lists what that Secret
must hold (the chart reads each variable the config names from it).

`charts/values.gpu.yaml` is rendered from configs/gateway.gpu.yaml (`make helm-values`);
`helm install llm charts/llm-serving -f charts/values.gpu.yaml` deploys it. The multi-node
example `charts/examples/values.deepseek-v3-two-nodes.yaml` is rendered from
charts/examples/deepseek-v3-two-nodes.gateway.yaml the same way.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.config import ModelEngines, read_mapping
from server.deploy import files
from server.deploy.compose import (
    HF_HOME,
    START_PERIOD,
    TINY_MODEL_IN_IMAGE,
    VLLM_CPU_IMAGE,
    VLLM_GPU_IMAGE,
)
from server.deploy.plan import (
    SERVICE_PORT,
    DeploymentPlan,
    PlannedModel,
    plan_deployment,
    slug,
)
from server.deploy.secrets import KEYS_IN_POD, LiteralKeys, SecretSources, secret_sources
from server.engine.profiles import Profile
from server.engine.render import KV_EVENTS_PORT, LWS_LEADER_ADDRESS, engine_argv, node_flags
from server.gateway.settings import load_settings

# Seconds an engine may take to answer /health after it starts: a model download and load.
STARTUP_SECONDS = {device: int(period.removesuffix("m")) * 60 for device, period in START_PERIOD.items()}
# The gateway's settings the chart sets itself (it listens on the pod's port; models are its engines).
CHART_OWNED_KEYS = ("host", "port", "models")
# The Secret the rendered values name when the config reads keys or secrets (create it before installing).
KEYS_SECRET = "llm-serving-keys"


class HelmError(ValueError):
    """A config that cannot be deployed with the chart, with the reason."""


def model_argument(profile: Profile) -> str | None:
    """What the engine container is told to load: a hub id as it is, the tiny model of the CPU image."""
    if profile.model_path is None:
        return None
    if profile.build_tiny_model and profile.device == "cpu":
        return TINY_MODEL_IN_IMAGE
    raise HelmError(
        f"{profile.name}: a model folder on this machine cannot reach a Kubernetes pod; "
        "name a hub id (`model: org/name`) in the profile"
    )


def engine_values(model: PlannedModel) -> dict[str, Any]:
    """One engine: the profile's replicas, image, vLLM arguments, GPUs a pod and start-up time.

    An engine over several nodes (a profile whose `data-parallel-size` is more than its
    `data-parallel-size-local`) runs as a LeaderWorkerSet group of `nodes` pods: the leader's
    `args` point vLLM at the group's leader (itself), the workers' `workerArgs` run headless;
    the chart adds each worker's `--data-parallel-start-rank` (its index x `ranksPerNode`).
    """
    profile = model.profile
    assert profile is not None and model.engines
    gpus = profile.gpus_per_node if profile.device == "gpu" else 0
    argv = engine_argv(
        profile,
        host="0.0.0.0",
        port=SERVICE_PORT,
        launcher="image",
        model=model_argument(profile),
        kv_events_port=KV_EVENTS_PORT,
    )
    multi_node: dict[str, Any] = {}
    if profile.nodes > 1:
        if profile.kv_events:
            raise HelmError(f"{profile.name}: KV events of an engine over several nodes are not rendered")
        head = engine_argv(profile, host=None, port=None, launcher="image", model=model_argument(profile))
        multi_node = {
            "ranksPerNode": profile.data_parallel_size_local,
            "workerArgs": head + ["--headless", "--data-parallel-address", LWS_LEADER_ADDRESS],
        }
        argv = argv + node_flags(profile, 0, LWS_LEADER_ADDRESS)
    return {
        "name": slug(model.name),
        "model": model.name,
        "profile": profile.name,
        "device": profile.device,
        "replicas": len(model.engines),
        "image": VLLM_GPU_IMAGE if profile.device == "gpu" else VLLM_CPU_IMAGE,
        "args": argv,
        "env": {"HF_HOME": HF_HOME, **profile.env},
        "gpus": gpus,
        "nodes": profile.nodes,
        **multi_node,
        "startupSeconds": STARTUP_SECONDS[profile.device],
    }


def gateway_model(model: PlannedModel) -> dict[str, Any]:
    """One `models:` entry of the gateway: its engines' Service (the chart names it), its DNS names or its URLs."""
    entry: dict[str, Any] = {"name": model.name}
    if model.engines:
        entry["engine"] = slug(model.name)
    elif model.entry.dns:
        entry["dns"] = list(model.entry.dns)
    else:
        entry["urls"] = list(model.remote)
    entry["trimming"] = model.trimming.model_dump(exclude_none=True)
    return entry


def render_values(plan: DeploymentPlan, *, config: Path, shutdown_grace: float) -> dict[str, Any]:
    """The chart values for a plan (engines, and the gateway's config and models)."""
    engines: list[dict[str, Any]] = []
    for model in plan.models:
        if not model.engines:
            continue
        if any(e["model"] == model.name for e in engines):
            raise HelmError(
                f"model {model.name!r} comes from two profile entries; in Kubernetes "
                "one Deployment serves it: set `replicas` in its profile instead"
            )
        engines.append(engine_values(model))
    if not plan.models:
        raise HelmError("the config names no model to serve")
    settings = {key: value for key, value in read_mapping(config).items() if key not in CHART_OWNED_KEYS}
    sources = _secret_sources(config)
    if isinstance(settings.get("tenants"), list):
        settings["tenants"] = [_tenant_in_pod(tenant) for tenant in settings["tenants"]]
    gateway: dict[str, Any] = {
        "shutdownGraceSeconds": math.ceil(shutdown_grace),
        "config": settings,
        "models": [gateway_model(model) for model in plan.models],
    }
    if secret_keys(sources):
        gateway["keysSecret"] = KEYS_SECRET
    return {"engines": engines, "gateway": gateway}


def _secret_sources(config: Path) -> SecretSources:
    try:
        return secret_sources(load_settings(config), config, "the chart's ConfigMap")
    except LiteralKeys as exc:
        raise HelmError(str(exc)) from None


def _tenant_in_pod(tenant: Any) -> Any:
    """A tenant's `api_keys_file` as the key of that file's name in the mounted keys Secret."""
    if not isinstance(tenant, dict) or not isinstance(tenant.get("api_keys_file"), str):
        return tenant
    return {**tenant, "api_keys_file": f"{KEYS_IN_POD}/{Path(tenant['api_keys_file']).name}"}


def secret_keys(sources: SecretSources) -> list[str]:
    """The keys the keys Secret must hold: each variable (a Secret key of its name), each key file's name."""
    keys = [*sources.variables, *([sources.redis_url_env] if sources.redis_url_env else [])]
    return keys + [Path(f.path).name for f in sources.files]


def render_file(models: Sequence[ModelEngines], *, config: Path, shutdown_grace: float) -> str:
    """The values file's text: a header that says where it comes from, then the values."""
    plan = plan_deployment(models, config=config, placement="services")
    values = render_values(plan, config=config, shutdown_grace=shutdown_grace)
    header = files.header(config, make="make helm-values", command="helm-values")
    if needed := secret_keys(_secret_sources(config)):
        header += (
            f"# The Secret {KEYS_SECRET} must hold: {', '.join(needed)} (and GATEWAY_ADMIN_KEYS for the admin API):\n"
            f"#   kubectl create secret generic {KEYS_SECRET} --from-literal=NAME=VALUE ... --from-file=FILE ...\n"
        )
    gpus = sum(e["gpus"] * e["nodes"] * e["replicas"] for e in values["engines"])
    if gpus:
        header += f"# NVIDIA GPUs requested in the cluster: {gpus}.\n"
    return header + files.dump(values)


def helm_values(
    models: Sequence[ModelEngines], *, config: Path, shutdown_grace: float, output: Path | None, check: bool
) -> int:
    """`python -m server helm-values`: print, write (`output`) or `check` the values file."""
    target = output or Path("charts/values.gpu.yaml")
    try:
        text = render_file(models, config=config, shutdown_grace=shutdown_grace)
    except HelmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return files.emit(
        {target: text}, main=target, write=output is not None, check=check, regenerate="`make helm-values`"
    )
