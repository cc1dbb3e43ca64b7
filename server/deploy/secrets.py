"""What a rendered deployment must hand the gateway from outside its files: tenants' keys and secrets.

A rendered file (docker/gateway*.yaml, the chart's ConfigMap) is committed, shared and shown by
`kubectl describe`: no key may be written in it. The renderers therefore refuse a config that
writes keys itself (a tenant's `api_keys`, `auth.admin_api_keys`) and instead pass on what the
gateway reads at start, by name: the variables (each tenant's `api_keys_env`, the admin keys'
`auth.admin_keys_env`, the `cache_isolation: tenant` salt's `tenant_salt_secret_env`, the Redis
URL's `quota_store.redis_url_env`) and the key files (`api_keys_file`). Compose passes the
variables through from the host (`VAR:` with no value: set only when the host sets it) and sees
key files under configs/; the chart reads the variables from a Secret (`gateway.keysSecret`) and
mounts that Secret's keys as files (KEYS_IN_POD).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from server.gateway.settings import GatewaySettings

# Where the chart mounts `gateway.keysSecret` in the gateway pod (one file per key of the Secret).
KEYS_IN_POD = "/etc/gateway-keys"


class LiteralKeys(ValueError):
    """A config that writes keys itself, which a renderer would copy into a shared file."""


@dataclass(frozen=True)
class KeyFile:
    tenant: str
    index: int  # the tenant's place in `tenants:`
    path: str  # as written in the config


@dataclass(frozen=True)
class SecretSources:
    """The variables and key files the gateway of a config reads its keys and secrets from."""

    variables: list[str] = field(default_factory=list)  # required ones: a tenant's keys, the salt, Redis
    optional: list[str] = field(default_factory=list)  # read when set: the admin keys
    files: list[KeyFile] = field(default_factory=list)
    redis_url_env: str | None = None  # with quota_store.backend: redis
    database_url_env: str | None = None  # with responses_store.backend: postgres
    tenants: bool = False  # with tenants every key is a tenant's: no `auth` keys beside them


def secret_sources(settings: GatewaySettings, config: Path, target: str) -> SecretSources:
    """What `settings` (loaded from `config`) reads from outside its file; LiteralKeys for keys
    written in it, naming the config, the key and `target` (the file they would be copied into)."""
    if settings.auth.admin_api_keys:
        raise LiteralKeys(
            f"{config}: auth.admin_api_keys: keys written in the config would be copied into {target}; "
            f"give them in ${settings.auth.admin_keys_env} (auth.admin_keys_env) instead"
        )
    variables: list[str] = []
    files: list[KeyFile] = []
    for i, tenant in enumerate(settings.tenants or ()):
        if tenant.api_keys:
            raise LiteralKeys(
                f"{config}: tenants.{i} ({tenant.name}).api_keys: keys written in the config would be copied "
                f"into {target}; name a variable (api_keys_env) or a file (api_keys_file) instead"
            )
        if tenant.api_keys_env and tenant.api_keys_env not in variables:
            variables.append(tenant.api_keys_env)
        if tenant.api_keys_file:
            files.append(KeyFile(tenant.name, i, tenant.api_keys_file))
    if any(t.cache_isolation == "tenant" for t in settings.tenants or ()):
        variables.append(settings.tenant_salt_secret_env)
    redis = settings.quota_store.redis_url_env if settings.quota_store.backend == "redis" else None
    store = settings.responses_store
    database = store.url_env if store.backend == "postgres" else None
    optional = [settings.auth.admin_keys_env]
    return SecretSources(
        variables=variables,
        optional=optional,
        files=files,
        redis_url_env=redis,
        database_url_env=database,
        tenants=settings.tenants is not None,
    )
