"""Optional API keys: `Authorization: Bearer KEY`, checked in constant time, never logged.

Keys come from an environment variable (comma-separated) and/or a file (one key a line, `#`
comments). With no keys configured the gateway is open. `/health`, `/ready` and `/metrics`
stay open unless `protect_ops_endpoints` is set, so probes and Prometheus need no key. Admin
endpoints (runtime LoRA load and unload) take their own keys (`admin_keys_env`) and are refused
when there are none.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from server.config import SettingsError
from server.gateway.errors import AuthenticationFailed
from server.gateway.settings import Auth


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
    """The keys of the admin endpoints (runtime LoRA load/unload), from `config.admin_keys_env`."""
    environ = os.environ if environ is None else environ
    keys = [k.strip() for k in environ.get(config.admin_keys_env, "").split(",")]
    return [k.encode() for k in dict.fromkeys(keys) if k]


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
