"""The gateway's one settings object, read from configs/gateway.yaml (or defaults for --upstream).

The file's `models` (server.config) say what is served and from which profiles; the launchers
(server.deploy) turn them into a deployment plan and hand the gateway its served models, so
nothing here knows which port an engine listens on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.config import ModelEngines, SettingsError, describe, read_mapping


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The routing policies by name (server.gateway.replicas.routing has one function each).
Policy = Literal["cache_aware", "least_outstanding", "round_robin"]


class Weights(BaseModel):
    """How much each scorer counts (0 turns it off). Defaults: measured, see the README's table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: float = Field(default=1.0, ge=0)
    balance: float = Field(default=2.0, ge=0)
    fit: float = Field(default=1.0, ge=0)  # a full, evicting cache pays for the blocks it would add
    kv_usage: float = Field(default=1.0, ge=0)
    queue: float = Field(default=1.0, ge=0)
    outstanding: float = Field(default=1.0, ge=0)
    spread: float = Field(default=1.0, ge=0)  # a replica above an even share of the recent requests
    session: float = Field(default=1.0, ge=0)


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
    # Seconds between two reads of a healthy engine's /v1/models: its max_model_len and its LoRA
    # adapters, as loaded through another worker, another gateway replica or the engine itself.
    models_interval: float = Field(default=10.0, gt=0)


class Discovery(_Strict):
    """Engines found by DNS (a model's `dns`, server.gateway.replicas.discovery)."""

    interval: float = Field(default=5.0, gt=0)  # seconds between two resolutions of every name
    timeout: float = Field(default=2.0, gt=0)  # for one lookup; a failed one keeps the engines known
    # `host` or `host:port` of DNS servers to ask; empty: the system's (/etc/resolv.conf, search domains).
    nameservers: list[str] = Field(default_factory=list)


class Retries(_Strict):
    """Retries on another replica, only before the first byte reached the client."""

    max_attempts: int = Field(default=3, ge=1)
    backoff: float = Field(default=0.05, ge=0)  # seconds, doubled per attempt


class Routing(_Strict):
    # cache_aware: scored (server.gateway.replicas.scoring); least_outstanding and round_robin:
    # after the affinity key below (server.gateway.replicas.routing).
    policy: Policy = "cache_aware"
    # cache_aware: which prefix index scores the prompt. precise: the engines' KV events (falls back
    # to approximate while an engine's events are missing); approximate: what the gateway sent where.
    prefix_index: Literal["precise", "approximate"] = "precise"
    weights: Weights = Field(default_factory=Weights)
    model_weights: dict[str, Weights] = Field(default_factory=dict)  # served model name -> its own weights
    block_chars: int = Field(default=256, ge=16)  # approximate index: characters per prompt block
    approximate_ttl: float = Field(default=600.0, gt=0)  # seconds a block sent stays in the record
    speculative_ttl: float = Field(default=2.0, ge=0)  # precise: seconds a routed prompt counts as held
    tokenize_timeout: float = Field(default=1.0, gt=0)  # precise: /tokenize; past it, approximate
    session_header: str = "x-session-id"
    # Requests whose first `prefix_chars` characters of prompt are equal prefer one engine...
    prefix_affinity: bool = True
    prefix_chars: int = Field(default=1024, ge=16)
    # Shorter prompts fit in less than one KV block; they gain nothing from affinity.
    prefix_min_chars: int = Field(default=256, ge=0)
    # ...unless it already has this many more outstanding requests than the least loaded one
    # (cache_aware: never a candidate then; also the load scorers' scale).
    max_imbalance: int = Field(default=8, ge=1)
    # cache_aware's split guard, at any concurrency: over the last `share_window` requests a model's
    # replicas were sent, none may take more than `max_split` times another's share (scoring.py).
    share_window: int = Field(default=48, ge=0)  # 0: no guard, no `spread` scorer
    max_split: float = Field(default=1.4, ge=1.0)

    def weights_for(self, model: str) -> Weights:
        return self.model_weights.get(model, self.weights)


class Auth(_Strict):
    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys in this variable
    api_keys_file: str | None = None  # one key per line
    protect_ops_endpoints: bool = False  # /health, /ready, /metrics behind the key too
    admin_keys_env: str = "GATEWAY_ADMIN_KEYS"  # comma-separated keys for runtime LoRA load/unload (none: off)
    # Admin keys written in the config (besides $admin_keys_env): runtime LoRA and GET /admin/usage;
    # never model traffic (docs/configure/tenants.md).
    admin_api_keys: list[str] = Field(default_factory=list)


class TenantLimits(_Strict):
    """A tenant's quotas (server.gateway.tenants.quota); an absent one is not enforced."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)  # prompt + completion
    max_concurrent: int | None = Field(default=None, ge=1)
    # The budgets above refill over this many seconds (60: per minute). Shorter only for tests.
    window_seconds: float = Field(default=60.0, gt=0)


class QuotaStore(_Strict):
    """Where tenants' quota counters live (server.gateway.tenants.counters, docs/operate/quotas.md).

    local: one set per host, shared by the `--workers` of one gateway (a file the supervisor
    creates); redis: one set for every gateway replica using the same server, its URL read from
    the variable `redis_url_env` (never from this file: it may hold a password)."""

    backend: Literal["local", "redis"] = "local"
    redis_url_env: str = "GATEWAY_REDIS_URL"


class ResponsesStore(_Strict):
    """Where the gateway keeps stored Responses (server.gateway.conversations, docs/operate/conversations.md).

    sqlite: one file for one host and its `--workers`: `path` (relative: to the config file's folder),
    by default responses.sqlite3 in the gateway's data folder ($GATEWAY_DATA_DIR, else ./data);
    postgres: one database for every gateway replica, its URL read from the variable `url_env`
    (never from this file: it may hold a password); off: `store: true` and `previous_response_id` refused."""

    backend: Literal["sqlite", "postgres", "off"] = "sqlite"
    path: Path | None = None
    url_env: str = "GATEWAY_DATABASE_URL"
    retention_days: float = Field(default=30.0, gt=0)  # OpenAI's default
    tenant_retention_days: dict[str, float] = Field(default_factory=dict)  # per tenant name
    purge_interval: float = Field(default=600.0, gt=0)  # seconds between two purges of expired responses


class Tenant(_Strict):
    """One caller of the gateway, known by its API keys alone (docs/configure/tenants.md)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a metrics label value
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None  # comma-separated keys in this variable
    api_keys_file: str | None = None  # one key a line, `#` comments
    priority: Literal["interactive", "standard", "batch"] = "standard"  # its class at the gate (settings Flow)
    models: list[str] | None = None  # served model or adapter names it may use; None: all
    limits: TenantLimits = Field(default_factory=TenantLimits)
    # tenant: the gateway sets vLLM's cache_salt for it (derived from $tenant_salt_secret_env and
    # the name), so no other tenant shares its prefix-cache blocks (server.gateway.tenants.isolation).
    cache_isolation: Literal["shared", "tenant"] = "shared"

    @model_validator(mode="after")
    def _has_a_key_source(self) -> Tenant:
        if not (self.api_keys or self.api_keys_env or self.api_keys_file):
            raise ValueError("a tenant needs api_keys, api_keys_env or api_keys_file")
        return self


PriorityClass = Literal["interactive", "standard", "batch"]  # first served first (server.gateway.flow)
_V = TypeVar("_V")


def _per_class(interactive: _V, standard: _V, batch: _V) -> dict[PriorityClass, _V]:
    return {"interactive": interactive, "standard": standard, "batch": batch}


class Flow(_Strict):
    """Priority classes and fair queueing when the engines are full (server.gateway.flow,
    docs/operate/flow-control.md); it gates tenants' requests only."""

    enabled: bool = True
    max_num_seqs: int | None = Field(default=None, ge=1)  # per engine; None: the profile's, else 256
    kv_usage_limit: float = Field(default=0.98, gt=0, le=1)  # an engine at this scraped KV usage counts as full
    max_wait: dict[PriorityClass, float] = Field(
        default_factory=lambda: _per_class(10.0, 60.0, 110.0)
    )  # seconds at the gate, then 429 (capped below timeouts.first_byte, which the wait counts toward)
    max_queued: dict[PriorityClass, int] = Field(default_factory=lambda: _per_class(1024, 1024, 1024))
    max_queued_total: int = Field(default=2048, ge=1)  # beyond it a higher class displaces the lowest
    # Share of each model's capacity batch requests leave free for the classes above (at least one
    # slot when above 0): vLLM preempts only for KV space, never for a full batch of sequences.
    batch_headroom: float = Field(default=0.0625, ge=0, lt=1)
    # vLLM's `priority` field from the class: None: when the profile sets scheduling-policy: priority.
    set_priority: bool | None = None
    expected_output_tokens: int = Field(default=256, ge=0)  # reserved when a request names no max_tokens
    tick_s: float = Field(default=0.25, gt=0)  # how often a non-empty queue looks for room besides departures


class Limits(_Strict):
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    max_upload_bytes: int = Field(default=25 * 2**20, ge=1024)  # multipart uploads (audio), OpenAI's own limit
    max_connections: int = Field(default=1024, ge=1)  # to each engine
    shutdown_grace: float = Field(default=30.0, ge=0)  # seconds for in-flight streams
    header_timeout: float = Field(default=10.0, gt=0)  # seconds for a request's headers to arrive
    body_timeout: float = Field(default=60.0, gt=0)  # seconds for its body, after the headers
    # Open client connections at once (per gateway process). At the cap a newcomer takes the slot of
    # an idle connection (none of its requests in progress), those that never carried an
    # authenticated request first, the longest idle first; 503 too_many_connections only when
    # every connection is busy (server.gateway.http.seam).
    max_client_connections: int = Field(default=4096, ge=1)
    # Per client address (the TCP peer: behind a proxy, the proxy), 0: no cap; a connection beyond
    # it is answered 429 too_many_connections_from_peer. max_connections_per_peer counts them all
    # (off by default: a load balancer in front is one peer). max_unauthenticated_per_peer counts
    # those on which no request has passed the API key check yet, only when the gateway has keys;
    # 1024 fits a client that opens hundreds of connections at once (the benchmarks open 768).
    max_connections_per_peer: int = Field(default=0, ge=0)
    max_unauthenticated_per_peer: int = Field(default=1024, ge=0)
    # A client's request head (request line and headers), refused 431 request_header_fields_too_large
    # and the connection closed: at most max_request_headers headers, each value at most
    # max_header_value_bytes, the whole head at most max_head_bytes (counted as it arrives, so a
    # bigger head is never held). Room for an SDK's headers, a long bearer token (a JWT of a few
    # KiB) and what proxies add; nginx's default is 8 KiB a line and 32 KiB in all.
    max_request_headers: int = Field(default=100, ge=8)
    max_header_value_bytes: int = Field(default=16 * 2**10, ge=256)
    max_head_bytes: int = Field(default=64 * 2**10, ge=1024)
    # An engine's answer the gateway reads whole (every non-streamed one): past this it is cut and
    # the client gets 502 engine_answer_too_large; memory per such answer stays under about twice
    # this. 64 MiB holds 8,192 tokens with 20 top logprobs each (~8 KiB a token in vLLM's JSON).
    max_answer_bytes: int = Field(default=64 * 2**20, ge=1024)
    # `--workers N`: a worker that dies is replaced (server.gateway.serving.supervisor) after
    # worker_restart_backoff seconds, doubled for each death of that worker in the last minute up
    # to worker_restart_backoff_max. More than worker_restarts_per_minute restarts (all workers
    # together) in the last 60 s: the supervisor stops the others and exits 1 (0: never restart).
    worker_restarts_per_minute: int = Field(default=10, ge=0)
    worker_restart_backoff: float = Field(default=0.5, ge=0)
    worker_restart_backoff_max: float = Field(default=10.0, ge=0)

    @model_validator(mode="after")
    def _backoff_within_its_cap(self) -> Limits:
        if self.worker_restart_backoff > self.worker_restart_backoff_max:
            raise ValueError("worker_restart_backoff must not be above worker_restart_backoff_max")
        return self

    @model_validator(mode="after")
    def _header_value_within_the_head(self) -> Limits:
        if self.max_header_value_bytes > self.max_head_bytes:
            raise ValueError("max_header_value_bytes must not be above max_head_bytes (a value is part of the head)")
        return self


class GatewaySettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Gateway processes sharing the port (SO_REUSEPORT, server.gateway.serving); "auto": one per
    # core this process may run on. 1: the gateway runs in the launching process itself.
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = 1
    models: list[ModelEngines] = Field(default_factory=list)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthCheck = Field(default_factory=HealthCheck)
    discovery: Discovery = Field(default_factory=Discovery)
    retries: Retries = Field(default_factory=Retries)
    routing: Routing = Field(default_factory=Routing)
    auth: Auth = Field(default_factory=Auth)
    limits: Limits = Field(default_factory=Limits)
    # Who may call, known by API key (server.gateway.tenants). None: today's single anonymous caller.
    tenants: list[Tenant] | None = Field(default=None, min_length=1)
    flow: Flow = Field(default_factory=Flow)  # the gate in front of full engines (server.gateway.flow)
    # The variable holding the secret the `cache_isolation: tenant` salts are derived from (HMAC-SHA256
    # of the tenant's name): the same in every worker and gateway replica; unset: refused at start.
    tenant_salt_secret_env: str = "GATEWAY_SALT_SECRET"
    quota_store: QuotaStore = Field(default_factory=QuotaStore)  # where the tenants' quotas are counted
    responses_store: ResponsesStore = Field(default_factory=ResponsesStore)  # stored Responses (conversations)
    metrics_scrape_interval: float = Field(default=5.0, gt=0)
    log_format: Literal["json", "text"] = "json"
    # One JSON line per request on `gateway.access` (observability.logs). False: none; the request
    # metrics and the error and warning lines stay (vLLM's --disable-log-requests, nginx's access_log off).
    access_log: bool = True
    # `module:function`s called with the FastAPI app once it is assembled: users' own routes,
    # dependencies and middleware (server.gateway.app.hooks). `serve --app-hook` adds to them.
    app_hooks: list[str] = Field(default_factory=list)

    source: Path | None = Field(default=None, exclude=True)

    @field_validator("tenants")
    @classmethod
    def _tenant_names_unique(cls, tenants: list[Tenant] | None) -> list[Tenant] | None:
        names = [tenant.name for tenant in tenants or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"names must be unique, given twice: {', '.join(twice)}")
        return tenants


def worker_count(workers: int | Literal["auto"] | str) -> int:
    """How many gateway processes `workers` means: a number, or "auto" (one per usable core).

    Usable cores: those this process may run on, and no more than a container's CPU limit
    (cgroup v2 `cpu.max`, rounded up). Raises SettingsError for anything else (the value of
    --workers or GATEWAY_WORKERS)."""
    if workers == "auto":
        return usable_cores()
    try:
        count = int(workers)
    except ValueError:
        raise SettingsError(f"workers must be a number >= 1 or 'auto', not {workers!r}") from None
    if not 1 <= count <= 256:
        raise SettingsError(f"workers must be between 1 and 256 or 'auto', not {count}")
    return count


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota if any."""
    import math
    import os

    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def load_settings(path: str | Path) -> GatewaySettings:
    """The settings of a config file (its profiles are read by the deployment plan)."""
    path = Path(path)
    try:
        settings = GatewaySettings.model_validate(read_mapping(path))
    except ValidationError as exc:
        raise SettingsError(describe(path, exc)) from None
    settings.source = path.resolve()
    return settings
