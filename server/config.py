"""The `models` of a config file, and the served models a launcher hands the gateway.

A config file (configs/gateway.yaml) holds the gateway's own settings (server.gateway.settings)
and `models`: what is served, each model either from a profile (engines this project starts) or
from URLs of engines that already run. The launchers (server.deploy) read `models` into a
deployment plan; the gateway is handed the result as `ServedModel`s and never reads profiles'
ports, profiles or model configs itself. This module is shared by both sides and imports neither
(an import-linter contract in pyproject.toml says so).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class TrimmingConfig(BaseModel):
    """How the gateway fits long chat histories into this engine (server.gateway.trimming);
    a profile's `trimming`, overridden by a `models:` entry's."""

    model_config = ConfigDict(extra="forbid")

    # auto: watermarks (cut well below the budget, then only append: the prefix cache keeps
    # hitting); window: the longest suffix that fits (the cut moves every turn); strict: refuse
    # what does not fit; off: send everything.
    mode: Literal["off", "window", "auto", "strict"] = "auto"
    # Tokens kept free for the answer when a request names neither max_tokens nor
    # max_completion_tokens.
    default_max_tokens: int = Field(default=256, ge=1)
    # A budget smaller than max_model_len - answer tokens, for history alone.
    history_budget_tokens: int | None = Field(default=None, ge=1)
    # auto: when a prompt passes the budget (the high mark), whole turns are dropped until it
    # fits this fraction of the budget (the low mark), or as near to it as the instructions and
    # the newest turn allow.
    low_mark: float = Field(default=0.65, gt=0.0, le=1.0)


class SettingsError(ValueError):
    """A config that cannot be used, with where and why."""


_DNS_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*\.?"
)


def parse_dns(target: str) -> tuple[str, int | None]:
    """`name:port` (A/AAAA records: every address on that port) or `_service._proto.name` (SRV
    records: each names a host and its port) -> (name, port or None); ValueError when neither."""
    name, sep, port = target.rpartition(":")
    if not sep:
        name = target
    if not _DNS_NAME.fullmatch(name):
        raise ValueError(f"{target!r}: expected NAME:PORT or _SERVICE._PROTO.NAME (SRV)")
    if sep:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{target!r}: the port must be 1..65535")
        return name, int(port)
    if not name.startswith("_"):
        raise ValueError(f"{target!r}: give the port (NAME:PORT), or an SRV name (_http._tcp.NAME)")
    return name, None


class ModelEngines(BaseModel):
    """One `models:` entry. Give `profile` (engines started from it), `urls` of running engines,
    or `dns`: names the gateway resolves every `discovery.interval` s for its engines' addresses."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None  # the served model name; from the profile when absent
    profile: str | None = None  # path relative to the config file
    urls: list[str] = Field(default_factory=list)  # where its engines run (none are started then)
    # Their KV-event endpoints (vLLM --kv-events-config), in the order of `urls`, e.g.
    # tcp://10.0.0.5:5557; "" for an engine that publishes none. Precise prefix routing needs them.
    kv_events: list[str] = Field(default_factory=list)
    # Engines found by DNS (server.gateway.replicas.discovery): `engine-tiny.default.svc:8000`, one
    # engine per address of the name (a headless Service, compose's `deploy.replicas`), or an SRV
    # name `_http._tcp.engine-tiny.default.svc`; with a profile, it gives trimming and capacity only.
    dns: list[str] = Field(default_factory=list)
    base_port: int | None = Field(default=None, ge=1, le=65535)  # first engine port for `up`
    trimming: TrimmingConfig | None = None  # overrides the profile's
    # Memory of one GPU (e.g. 80GiB) the deployment renderers plan a GPU profile's KV cache with.
    device_memory: str | None = None
    # KV-cache tokens planned for each engine, written by the renderers (compose) so the gateway
    # need not read the model's config.json; the gateway plans from the profile when absent.
    planned_kv_tokens: int | None = Field(default=None, ge=0)

    @field_validator("dns", mode="before")
    @classmethod
    def _dns_names(cls, value: object) -> object:
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list):
            for name in names:
                if isinstance(name, str):
                    parse_dns(name)
        return names

    @model_validator(mode="after")
    def _one_source(self) -> ModelEngines:
        if not self.profile and not self.urls and not self.dns:
            raise ValueError("give `profile`, `urls` or `dns`")
        if self.urls and self.dns:
            raise ValueError("give `urls` or `dns`, not both")
        if not self.profile and not self.name:
            raise ValueError("a model named by `urls` or `dns` needs `name`")
        if len(self.kv_events) > len(self.urls):
            raise ValueError("`kv_events` has more endpoints than `urls` has engines")
        return self


@dataclass
class ServedModel:
    """One model as the gateway serves it: plain data the launcher worked out from the profile
    (server.deploy.plan), so that the gateway never reads a profile or a model's config.json."""

    name: str
    urls: list[str]
    trimming: TrimmingConfig = field(default_factory=lambda: TrimmingConfig(mode="off"))
    kv_events: dict[str, str] = field(default_factory=dict)  # engine URL -> its KV-event endpoint (ZMQ)
    dns: list[str] = field(default_factory=list)  # names resolved for more engines (ModelEngines.dns)
    planned_kv_tokens: int | None = None  # KV-cache tokens per engine: the config's, else the planner's
    max_model_len: int | None = None  # the profile's, until an engine reports its own
    block_size: int | None = None  # the profile's KV-cache block size, until the engines report theirs
    max_num_seqs: int | None = None  # the profile's vLLM max-num-seqs: the batch the flow gate fills (issue 32)
    priority_scheduling: bool = False  # the profile sets scheduling-policy: priority (requests get `priority`)


def profile_path(entry: ModelEngines, config: Path | None) -> Path | None:
    """The entry's profile file; a relative path is relative to the config file."""
    if entry.profile is None:
        return None
    path = Path(entry.profile)
    if not path.is_absolute() and config is not None:
        path = config.parent / path
    return path


def read_mapping(path: Path) -> dict[str, Any]:
    """A config file's top-level mapping, or a SettingsError naming the file."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such gateway config") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def describe(path: Path, exc: ValidationError) -> str:
    """`path: where: what` for every problem pydantic found, in one line."""
    problems = "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )
    return f"{path}: {problems}"


def parse_upstreams(items: Iterable[str]) -> list[ModelEngines]:
    """`NAME=URL` pairs from the command line; one NAME given twice is two replicas."""
    by_name: dict[str, list[str]] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SettingsError(f"--upstream {item!r}: expected NAME=http://host:port")
        by_name.setdefault(name, []).append(url.rstrip("/"))
    return [ModelEngines(name=name, urls=urls) for name, urls in by_name.items()]
