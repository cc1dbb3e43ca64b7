"""The gateway's one settings object, read from configs/gateway.yaml or built from --upstream.

A model is served by one or more engine replicas. A model either comes from a profile (the
gateway's `up` command launches its engines; its trimming settings and planned KV capacity come
along) or is named by URLs of engines that already run (`serve --upstream NAME=URL`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.engine.profiles import Profile, ProfileError, TrimmingConfig, load_profile


class SettingsError(ValueError):
    """A gateway config that cannot be used, with where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Timeouts(_Strict):
    """Seconds. LLM traffic needs long first-byte and total limits, short connect limits."""

    connect: float = Field(default=5.0, gt=0)
    first_byte: float = Field(default=120.0, gt=0)  # request sent -> response headers/first chunk
    idle: float = Field(default=60.0, gt=0)  # between two chunks of a stream
    total: float = Field(default=1800.0, gt=0)  # whole request, streaming included


class HealthCheck(_Strict):
    interval: float = Field(default=2.0, gt=0)
    timeout: float = Field(default=2.0, gt=0)
    unhealthy_after: int = Field(default=2, ge=1)  # consecutive failures that eject an engine
    healthy_after: int = Field(default=1, ge=1)  # consecutive successes that restore it


class Retries(_Strict):
    """Retries on another replica, only before the first byte reached the client."""

    max_attempts: int = Field(default=3, ge=1)
    backoff: float = Field(default=0.05, ge=0)  # seconds, doubled per attempt


class Routing(_Strict):
    policy: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    session_header: str = "x-session-id"
    # Requests whose first `prefix_chars` characters of prompt are equal prefer one engine...
    prefix_affinity: bool = True
    prefix_chars: int = Field(default=1024, ge=16)
    # Shorter prompts fit in less than one KV block; they gain nothing from affinity.
    prefix_min_chars: int = Field(default=256, ge=0)
    # ...unless it already has this many more outstanding requests than the least loaded one.
    max_imbalance: int = Field(default=8, ge=1)


class Auth(_Strict):
    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys in this variable
    api_keys_file: str | None = None  # one key per line
    protect_ops_endpoints: bool = False  # /health, /ready, /metrics behind the key too


class Limits(_Strict):
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    max_connections: int = Field(default=1024, ge=1)  # to each engine
    shutdown_grace: float = Field(default=30.0, ge=0)  # seconds for in-flight streams


class ModelEngines(_Strict):
    """One served model. Give `profile` (launched by `up`), or `urls` of running engines."""

    name: str | None = None  # the served model name; from the profile when absent
    profile: str | None = None  # path relative to the gateway config file
    urls: list[str] = Field(default_factory=list)
    base_port: int | None = Field(default=None, ge=1, le=65535)  # first engine port for `up`
    trimming: TrimmingConfig | None = None  # overrides the profile's

    @model_validator(mode="after")
    def _one_source(self) -> ModelEngines:
        if not self.profile and not self.urls:
            raise ValueError("give `profile` or `urls`")
        if not self.profile and not self.name:
            raise ValueError("a model named by `urls` needs `name`")
        return self


@dataclass
class ResolvedModel:
    """One served model after the config and its profile are read together."""

    name: str
    urls: list[str]
    profile: Profile | None
    trimming: TrimmingConfig


class GatewaySettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    models: list[ModelEngines] = Field(default_factory=list)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthCheck = Field(default_factory=HealthCheck)
    retries: Retries = Field(default_factory=Retries)
    routing: Routing = Field(default_factory=Routing)
    auth: Auth = Field(default_factory=Auth)
    limits: Limits = Field(default_factory=Limits)
    metrics_scrape_interval: float = Field(default=5.0, gt=0)
    log_format: Literal["json", "text"] = "json"
    log_content: bool = False  # put message content in request logs (off: never)

    source: Path | None = Field(default=None, exclude=True)

    def profile_path(self, model: ModelEngines) -> Path | None:
        if model.profile is None:
            return None
        path = Path(model.profile)
        if not path.is_absolute() and self.source is not None:
            path = self.source.parent / path
        return path

    def resolve_models(self, profiles: dict[str, Profile]) -> list[ResolvedModel]:
        """Each served model with its engine URLs, profile and trimming settings.

        URLs are the given `urls`, or for a profile model the ports `up` launches its replicas
        on: base_port + i, where a model without base_port continues after the previous one.
        Trimming is the model's own `trimming`, else its profile's, else off.
        """
        out: dict[str, ResolvedModel] = {}
        next_port = 8100
        for model in self.models:
            profile = self._profile_of(model, profiles)
            name = model.name or (profile.served_model_name if profile else "")
            if model.urls:
                urls = list(model.urls)
            else:
                base = model.base_port or next_port
                replicas = profile.replicas if profile else 1
                urls = [f"http://127.0.0.1:{base + i}" for i in range(replicas)]
                next_port = base + replicas
            trimming = model.trimming or (profile.trimming if profile else TrimmingConfig(mode="off"))
            if name in out:  # the same model named twice: more replicas
                out[name].urls.extend(u.rstrip("/") for u in urls)
            else:
                out[name] = ResolvedModel(name, [u.rstrip("/") for u in urls], profile, trimming)
        return list(out.values())

    def _profile_of(self, model: ModelEngines, profiles: dict[str, Profile]) -> Profile | None:
        if model.profile is None:
            return None
        if model.name and model.name in profiles:
            return profiles[model.name]
        loaded = load_profile(self.profile_path(model))  # type: ignore[arg-type]
        return profiles.get(loaded.served_model_name, loaded)

    def load_profiles(self) -> dict[str, Profile]:
        """The profiles named by this config, by served model name."""
        out = {}
        for model in self.models:
            path = self.profile_path(model)
            if path is None:
                continue
            profile = load_profile(path)
            out[model.name or profile.served_model_name] = profile
        return out


def load_settings(path: str | Path) -> GatewaySettings:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such gateway config") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping, got {type(data).__name__}")
    try:
        settings = GatewaySettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise SettingsError(f"{path}: {problems}") from None
    settings.source = path.resolve()
    try:
        settings.load_profiles()
    except ProfileError as exc:
        raise SettingsError(f"{path}: {exc}") from None
    return settings


def parse_upstreams(items: list[str]) -> list[ModelEngines]:
    """`NAME=URL` pairs from the command line; one NAME given twice is two replicas."""
    by_name: dict[str, list[str]] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SettingsError(f"--upstream {item!r}: expected NAME=http://host:port")
        by_name.setdefault(name, []).append(url.rstrip("/"))
    return [ModelEngines(name=name, urls=urls) for name, urls in by_name.items()]
