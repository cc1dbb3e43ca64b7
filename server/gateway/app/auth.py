"""Optional API keys: `Authorization: Bearer KEY`, checked in constant time, never logged.

Keys come from an environment variable (comma-separated) and/or a file (one key a line, `#`
comments). With no keys configured the gateway is open. `/health`, `/ready` and `/metrics`
stay open unless `protect_ops_endpoints` is set, so probes and Prometheus need no key. Admin
endpoints (runtime LoRA load and unload, /admin/usage) take their own keys (`admin_api_keys`,
`admin_keys_env`) and are refused when there are none. With `tenants:` every model key belongs
to one tenant (`load_tenants`, `identify_tenant`; server.gateway.tenants).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from server.config import SettingsError
from server.gateway.errors import AuthenticationFailed
from server.gateway.settings import Auth, GatewaySettings, Tenant
from server.gateway.tenants.directory import TenantDirectory, TenantRuntime


def load_api_keys(config: Auth, environ: Mapping[str, str] | None = None, base: Path | None = None) -> list[bytes]:
    """The accepted keys, from `config.api_keys_env` and `config.api_keys_file`.

    A variable or file that is there but holds no key (`""`, `","`, only comments) is refused:
    it means someone meant to protect the gateway, and an open gateway would be the surprise.
    """
    environ = os.environ if environ is None else environ
    keys: list[str] = []
    if config.api_keys_env in environ:
        from_env = [k.strip() for k in environ[config.api_keys_env].split(",") if k.strip()]
        if not from_env:
            raise SettingsError(
                f"auth: ${config.api_keys_env} is set but holds no API key; set keys "
                f"(comma-separated) or unset it to run without keys"
            )
        keys += from_env
    if config.api_keys_file:
        path = Path(config.api_keys_file)
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise SettingsError(f"auth.api_keys_file {path}: cannot read: {exc.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise SettingsError(f"auth.api_keys_file {path}: holds no API key")
        keys += from_file
    return [k.encode() for k in dict.fromkeys(keys)]


def load_admin_keys(config: Auth, environ: Mapping[str, str] | None = None) -> list[bytes]:
    """The keys of the admin endpoints (runtime LoRA load/unload, /admin/usage), from
    `config.admin_api_keys` and `config.admin_keys_env`."""
    environ = os.environ if environ is None else environ
    keys = [k.strip() for k in [*config.admin_api_keys, *environ.get(config.admin_keys_env, "").split(",")]]
    return [k.encode() for k in dict.fromkeys(keys) if k]


def load_tenants(
    settings: GatewaySettings,
    environ: Mapping[str, str] | None = None,
    *,
    admin_keys: Sequence[bytes] = (),
) -> TenantDirectory | None:
    """The tenants of `settings` with their keys (None without `tenants:`); SettingsError naming
    the config file and the key for a variable that is not set, a file that cannot be read, a
    tenant without keys, a key given to two tenants or also an admin key, or `auth` keys beside tenants."""
    if settings.tenants is None:
        return None
    environ = os.environ if environ is None else environ
    where = str(settings.source) if settings.source else "the gateway config"
    base = settings.source.parent if settings.source else None
    if settings.auth.api_keys_env in environ or settings.auth.api_keys_file:
        raise SettingsError(
            f"{where}: tenants: with tenants every key belongs to a tenant, but auth keys are configured too "
            f"(${settings.auth.api_keys_env} or auth.api_keys_file): move them into a tenant's api_keys_env"
        )
    owners: dict[bytes, str] = dict.fromkeys(admin_keys, "the admin keys")
    loaded: list[tuple[Tenant, list[bytes]]] = []
    for index, tenant in enumerate(settings.tenants):
        at = f"{where}: tenants.{index} ({tenant.name})"
        keys = [k.strip() for k in tenant.api_keys if k.strip()]
        if tenant.api_keys_env is not None:
            if tenant.api_keys_env not in environ:
                raise SettingsError(f"{at}.api_keys_env: ${tenant.api_keys_env} is not set")
            keys += [k.strip() for k in environ[tenant.api_keys_env].split(",") if k.strip()]
        if tenant.api_keys_file is not None:
            path = Path(tenant.api_keys_file)
            path = base / path if not path.is_absolute() and base is not None else path
            try:
                lines = path.read_text().splitlines()
            except OSError as exc:
                raise SettingsError(f"{at}.api_keys_file: {path}: cannot read: {exc.strerror}") from None
            keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise SettingsError(f"{at}: holds no API key (api_keys, api_keys_env, api_keys_file are all empty)")
        encoded = [k.encode() for k in dict.fromkeys(keys)]
        for key in encoded:
            if key in owners:  # said without the key itself
                raise SettingsError(
                    f"{at}: one of its API keys is also a key of {owners[key]}; each key is one caller's"
                )
            owners[key] = f"tenant {tenant.name}"
        loaded.append((tenant, encoded))
    return TenantDirectory(loaded)


def identify_tenant(headers: list[tuple[bytes, bytes]], tenants: TenantDirectory) -> TenantRuntime:
    """The tenant of the request's key (the key alone: nothing else the client sends is read), or
    AuthenticationFailed."""
    token = bearer_token(headers)
    if token is None:
        raise AuthenticationFailed(
            "Missing API key: send it as `Authorization: Bearer YOUR_KEY`.", headers=[(b"www-authenticate", b"Bearer")]
        )
    tenant = tenants.find(token)
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.", headers=[(b"www-authenticate", b"Bearer")])
    return tenant


def key_matches(presented: bytes, keys: list[bytes]) -> bool:
    """Compare against every key (no early exit), each in constant time."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def check_api_key(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> None:
    """Raise AuthenticationFailed unless the request carries one of `keys` (no keys: open)."""
    if not keys:
        return
    token = bearer_token(headers)
    if token is None:
        raise AuthenticationFailed(
            "Missing API key: send it as `Authorization: Bearer YOUR_KEY`.", headers=[(b"www-authenticate", b"Bearer")]
        )
    if not key_matches(token, keys):
        raise AuthenticationFailed("Incorrect API key provided.", headers=[(b"www-authenticate", b"Bearer")])
