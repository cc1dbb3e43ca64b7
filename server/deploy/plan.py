"""The deployment plan: which engines run, for which model, where, and on which GPUs.

Computed once from a config's `models` and their profiles, and read by everything that deploys:
`up` starts these engines (server.deploy.local), the compose renderer gives each its own service
(server.deploy.compose), the Helm values give each model a Deployment (server.deploy.helm). What
the gateway is handed (`served_models()`) comes from the same plan, so a launcher and the gateway
in front of it cannot disagree on where an engine listens.

- A profile entry becomes `profile.replicas` engines, numbered per model (a second entry with the
  same served name continues the numbering). An entry with `urls` names engines that run
  elsewhere, and none are started for it; its profile still gives trimming and capacity (the
  gateway config compose renders is such a file). So does an entry with `dns`: the gateway finds
  its engines by resolving those names. Entries of one served name are one model.
- Engines listen on this host, one port each (`placement="local"`: `base_port`, `base_port+1`,
  ...; an entry without `base_port` continues after the previous one, from 8100), or one container
  or pod each, reached by its service name on port 8000 (`placement="services"`).
- An engine of a profile with `kv_events: true` publishes its KV-cache events on a port of its
  own (server.engine.render: the HTTP port + 10000 on this host, 5557 in a container or pod); the
  gateway is handed each engine's endpoint, as it is for engines by URL with `kv_events`.
- GPU engines get GPUs of their own, in order: replica 0 of the first model 0..tp*pp-1, the next
  the following ones (compose pins them; a single-host `up` leaves placement to vLLM).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from server.config import ModelEngines, ServedModel, SettingsError, TrimmingConfig, profile_path
from server.engine.planner import parse_size, plan_profile
from server.engine.profiles import Profile, ProfileError, load_profile
from server.engine.render import KV_EVENTS_PORT, local_kv_events_port

Placement = Literal["local", "services"]

LOCAL_HOST = "127.0.0.1"
FIRST_LOCAL_PORT = 8100
SERVICE_PORT = 8000  # what an engine listens on inside its container or pod


@dataclass(frozen=True)
class PlannedEngine:
    """One engine process: one replica of one profile."""

    model: str  # the served model name the gateway routes by
    replica: int  # 0, 1, ... within its model
    profile: Profile
    service: str  # `engine-<model>-<replica>`, a DNS label: its compose service, its log name
    host: str
    port: int
    gpus: tuple[int, ...] = ()  # GPU indices reserved for it (GPU profiles)
    kv_events_port: int | None = None  # where it publishes KV events (profiles with kv_events)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events(self) -> str | None:
        """The ZMQ endpoint the gateway subscribes to."""
        return f"tcp://{self.host}:{self.kv_events_port}" if self.kv_events_port is not None else None


@dataclass(frozen=True)
class PlannedModel:
    """One `models:` entry: the engines started for it here, and engines elsewhere by URL."""

    entry: ModelEngines  # as the config wrote it
    name: str
    profile: Profile | None
    profile_path: Path | None
    trimming: TrimmingConfig
    engines: tuple[PlannedEngine, ...]
    remote: tuple[str, ...]  # URLs of engines that run elsewhere

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines] + list(self.remote)

    @property
    def kv_events(self) -> dict[str, str]:
        """Engine URL -> KV-event endpoint, for the engines that publish them."""
        out = {engine.url: endpoint for engine in self.engines if (endpoint := engine.kv_events)}
        pairs = zip(self.remote, self.entry.kv_events, strict=False)  # fewer endpoints than URLs: the rest publish none
        out.update((url, endpoint) for url, endpoint in pairs if endpoint)
        return out


@dataclass(frozen=True)
class DeploymentPlan:
    """Every model entry of a config, in config order, with its engines."""

    models: tuple[PlannedModel, ...]

    @property
    def engines(self) -> list[PlannedEngine]:
        return [engine for model in self.models for engine in model.engines]

    @property
    def gpu_count(self) -> int:
        return sum(len(engine.gpus) for engine in self.engines)

    def served_models(self) -> list[ServedModel]:
        """What the gateway serves: one per name, entries of one name joined as replicas.

        The first entry of a name gives the profile's figures (max_model_len, block size, the
        planned KV-cache tokens) and the trimming settings: plain data, the gateway reads no profile.
        """
        out: dict[str, ServedModel] = {}
        for model in self.models:
            if model.name in out:
                out[model.name].urls.extend(model.urls)
                out[model.name].kv_events.update(model.kv_events)
                out[model.name].dns.extend(model.entry.dns)
            else:
                out[model.name] = served_model(
                    model.name,
                    model.urls,
                    model.profile,
                    trimming=model.trimming,
                    kv_events=model.kv_events,
                    dns=list(model.entry.dns),
                    planned_kv_tokens=model.entry.planned_kv_tokens,
                    device_memory=model.entry.device_memory,
                )
        return list(out.values())


def served_model(
    name: str,
    urls: list[str],
    profile: Profile | None,
    *,
    trimming: TrimmingConfig | None = None,
    kv_events: dict[str, str] | None = None,
    dns: list[str] | None = None,
    planned_kv_tokens: int | None = None,
    device_memory: str | None = None,
) -> ServedModel:
    """What the gateway serves of a model whose engines run `profile`: its figures as plain data.

    max_model_len and the KV block size from the profile; the KV-cache tokens per engine as given
    (the deployment renderers write them into the config), else planned from the profile (a GPU
    profile plans with `device_memory`), else None (no profile, a GPU profile without a memory
    figure, no config.json to plan from). `trimming`: as given, else off (as a ServedModel's)."""
    if planned_kv_tokens is None and profile is not None:
        try:
            memory = parse_size(device_memory) if device_memory else None
            planned_kv_tokens = plan_profile(profile, memory).kv_cache_tokens
        except Exception:  # noqa: BLE001 - a plan is a nice-to-have for the gateway (capacity shown beside usage)
            planned_kv_tokens = None
    served = ServedModel(
        name,
        urls,
        kv_events=dict(kv_events or {}),
        dns=list(dns or []),
        planned_kv_tokens=planned_kv_tokens,
        max_model_len=profile.max_model_len if profile else None,
        block_size=profile.block_size if profile else None,
        max_num_seqs=seqs if profile and isinstance(seqs := profile.vllm.get("max-num-seqs"), int) else None,
        priority_scheduling=bool(profile and profile.vllm.get("scheduling-policy") == "priority"),
    )
    if trimming is not None:
        served.trimming = trimming
    return served


def service_name(model: str, replica: int) -> str:
    """`engine-<model>-<i>`, with the model name cut down to what a DNS label allows."""
    return f"engine-{slug(model)}-{replica}"


def slug(model: str) -> str:
    """A model name as a DNS label: lower case, runs of other characters as one `-`."""
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")


def plan_deployment(
    models: Sequence[ModelEngines], *, config: Path | None = None, placement: Placement = "local"
) -> DeploymentPlan:
    """The plan for a config's `models` (profile paths relative to the file `config`)."""
    planned: list[PlannedModel] = []
    next_port = FIRST_LOCAL_PORT
    next_gpu = 0
    replicas_of: dict[str, int] = {}
    services: set[str] = set()
    for entry in models:
        path = profile_path(entry, config)
        profile = _load(path, config) if path is not None else None
        name = entry.name or (profile.served_model_name if profile else "")
        remote = tuple(url.rstrip("/") for url in entry.urls)
        trimming = entry.trimming or (profile.trimming if profile else TrimmingConfig(mode="off"))
        engines: list[PlannedEngine] = []
        if profile is not None and not remote and not entry.dns:
            base = entry.base_port or next_port
            for i in range(profile.replicas):
                replica = replicas_of.get(name, 0)
                replicas_of[name] = replica + 1
                service = service_name(name, replica)
                if service in services:
                    raise SettingsError(f"two models render to the service name {service!r}; rename one")
                services.add(service)
                gpus: tuple[int, ...] = ()
                if profile.device == "gpu":
                    width = profile.gpus_per_node  # tensor x pipeline x local data-parallel ranks
                    gpus = tuple(range(next_gpu, next_gpu + width))
                    next_gpu += width
                host, port = (LOCAL_HOST, base + i) if placement == "local" else (service, SERVICE_PORT)
                events = None
                if profile.kv_events:
                    events = local_kv_events_port(port) if placement == "local" else KV_EVENTS_PORT
                engines.append(PlannedEngine(name, replica, profile, service, host, port, gpus, events))
            next_port = base + profile.replicas
        planned.append(PlannedModel(entry, name, profile, path, trimming, tuple(engines), remote))
    return DeploymentPlan(tuple(planned))


def _load(path: Path, config: Path | None) -> Profile:
    try:
        return load_profile(path)
    except ProfileError as exc:
        raise SettingsError(f"{config}: {exc}" if config else str(exc)) from None
