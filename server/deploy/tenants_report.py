"""`python -m server tenants`: the tenants of a gateway config, and what each used on a running gateway.

For each tenant: its priority, allowed models, cache isolation, limits, and its keys as
fingerprints (`sha256:` and the first 12 hex digits of the key's SHA-256: enough to tell keys apart
and to match one an operator holds, `printf %s KEY | sha256sum`, never enough to use one) with where
each came from; a key source that is not there (a variable not set, a file not readable) is said
as such, not an error, since the command often runs away from the gateway's host. With `--url`,
the live usage from that gateway's `GET /admin/usage` (an admin key from a variable, never from
the command line, where `ps` and shell history would show it), per tenant and model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.gateway.settings import GatewaySettings, Tenant, load_settings

FINGERPRINT_HEX = 12


class ReportError(Exception):
    """What stops the report, said in one line (the gateway unreachable, the admin key refused)."""


def fingerprint(key: str) -> str:
    """A key's short, one-way name: `sha256:` and the first 12 hex digits of its SHA-256."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:FINGERPRINT_HEX]


@dataclass
class TenantKeys:
    keys: list[tuple[str, str]] = field(default_factory=list)  # (fingerprint, where it came from)
    missing: list[str] = field(default_factory=list)  # sources that are not there, in words


def tenant_keys(tenant: Tenant, environ: Mapping[str, str], base: Path | None) -> TenantKeys:
    """A tenant's keys as fingerprints, read as the gateway reads them (server.gateway.app.auth)."""
    out = TenantKeys()
    seen: set[str] = set()

    def add(key: str, source: str) -> None:
        key = key.strip()
        if key and key not in seen:
            seen.add(key)
            out.keys.append((fingerprint(key), source))

    for key in tenant.api_keys:
        add(key, "the config")
    if tenant.api_keys_env:
        if tenant.api_keys_env in environ:
            for key in environ[tenant.api_keys_env].split(","):
                add(key, f"${tenant.api_keys_env}")
        else:
            out.missing.append(f"${tenant.api_keys_env} is not set here")
    if tenant.api_keys_file:
        path = Path(tenant.api_keys_file)
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            out.missing.append(f"{path}: cannot read: {exc.strerror}")
        else:
            for line in lines:
                if line.strip() and not line.strip().startswith("#"):
                    add(line, str(tenant.api_keys_file))
    return out


def fetch_usage(url: str, admin_key: str, since: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """The gateway's `GET /admin/usage` (JSON); ReportError saying why not, without the key."""
    params = {"since": since} if since else {}
    try:
        response = httpx.get(
            f"{url.rstrip('/')}/admin/usage",
            params=params,
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise ReportError(f"cannot reach the gateway at {url}: {type(exc).__name__}: {exc}") from None
    if response.status_code == 200:
        try:
            data: dict[str, Any] = response.json()
        except ValueError:
            raise ReportError(f"{url}/admin/usage answered 200 but not JSON: is this the gateway?") from None
        return data
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    if response.status_code == 404:
        raise ReportError(f"the gateway at {url} has no /admin/usage: it runs without tenants ({message})")
    raise ReportError(f"the gateway at {url} answered {response.status_code}: {message}")


def build_report(
    settings: GatewaySettings,
    config: Path,
    *,
    environ: Mapping[str, str],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report as data (what `--json` prints)."""
    base = settings.source.parent if settings.source else None
    rows = usage["data"] if usage else []
    tenants = []
    for tenant in settings.tenants or ():
        keys = tenant_keys(tenant, environ, base)
        tenants.append(
            {
                "name": tenant.name,
                "priority": tenant.priority,
                "models": tenant.models,
                "cache_isolation": tenant.cache_isolation,
                "limits": tenant.limits.model_dump(exclude_none=True),
                "keys": [{"fingerprint": f, "source": s} for f, s in keys.keys],
                "key_sources_missing": keys.missing,
                "usage": [r for r in rows if r["tenant"] == tenant.name] if usage else None,
            }
        )
    known = {t.name for t in settings.tenants or ()}
    report: dict[str, Any] = {"config": str(config), "tenants": tenants}
    if usage is not None:
        report["usage"] = {
            "since": usage.get("since"),
            "until": usage.get("until"),
            "scope": usage.get("scope"),
            "other_tenants": [r for r in rows if r["tenant"] not in known],
        }
    return report


def _usage_line(row: dict[str, Any]) -> str:
    statuses = ", ".join(f"{code} x{count}" for code, count in row["requests"].items())
    return (
        f"    {row['model']}: requests {statuses or 'none'}; prompt tokens {row['prompt_tokens']} "
        f"(cached {row['cached_prompt_tokens']}), completion tokens {row['completion_tokens']}"
    )


def render_text(report: dict[str, Any], url: str | None) -> str:
    tenants = report["tenants"]
    if not tenants:
        return f"{report['config']}: no tenants (every caller is the same; see docs/configure/tenants.md)\n"
    lines = [f"{len(tenants)} tenant{'s' if len(tenants) != 1 else ''} in {report['config']}"]
    usage = report.get("usage")
    if usage is not None:
        since = usage["since"]
        lines.append(
            f"usage from {url} since {_when(since) if since is not None else 'the process started'} "
            f"until {_when(usage['until'])}"
            + (" (the one gateway process that answered; with --workers N see gateway_tenant_* in Prometheus)"
               if usage.get("scope") == "process" else "")
        )  # fmt: skip
    for tenant in tenants:
        models = ", ".join(tenant["models"]) if tenant["models"] is not None else "all"
        lines += [
            "",
            f"{tenant['name']}: priority {tenant['priority']}, models {models}, "
            f"cache_isolation {tenant['cache_isolation']}",
            f"  limits: {limits_text_from(tenant['limits'])}",
        ]
        keys = [f"{k['fingerprint']} ({k['source']})" for k in tenant["keys"]]
        lines.append(f"  keys: {', '.join(keys) if keys else 'none found here'}")
        lines += [f"  not read: {missing}" for missing in tenant["key_sources_missing"]]
        if tenant["usage"] is not None:
            lines += [_usage_line(row) for row in tenant["usage"]] or ["    no requests"]
    if usage is not None and usage["other_tenants"]:
        lines += ["", "tenants of the gateway not in this config:"]
        lines += [f"  {row['tenant']}" + _usage_line(row).removeprefix("   ") for row in usage["other_tenants"]]
    return "\n".join(lines) + "\n"


def limits_text_from(limits: dict[str, Any]) -> str:
    window = limits.get("window_seconds", 60)
    unit = "min" if window == 60 else f"{window:g} s"
    parts = [
        f"{limits['requests_per_minute']} requests/{unit}" if limits.get("requests_per_minute") else None,
        f"{limits['tokens_per_minute']} tokens/{unit}" if limits.get("tokens_per_minute") else None,
        f"{limits['max_concurrent']} concurrent" if limits.get("max_concurrent") else None,
    ]
    return ", ".join(p for p in parts if p) or "none"


def _when(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tenants_command(
    config: Path,
    *,
    url: str | None,
    admin_key_env: str | None,
    since: str | None,
    as_json: bool,
    environ: Mapping[str, str] | None = None,
) -> int:
    """`python -m server tenants`: 0, or 1 when the gateway cannot be asked, 2 for a bad invocation."""
    environ = os.environ if environ is None else environ
    settings = load_settings(config)  # SettingsError (exit 2, the file and the key) for a bad config
    usage = None
    if url is not None:
        variable = admin_key_env or settings.auth.admin_keys_env
        keys = [k.strip() for k in environ.get(variable, "").split(",") if k.strip()]
        if not keys:
            print(
                f"error: --url needs an admin key of the gateway in ${variable} "
                "(or name another variable with --admin-key-env)",
                file=sys.stderr,
            )
            return 2
        try:
            usage = fetch_usage(url, keys[0], since)
        except ReportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    elif since is not None:
        print("error: --since needs --url (the gateway to ask)", file=sys.stderr)
        return 2
    report = build_report(settings, config, environ=environ, usage=usage)
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if as_json else render_text(report, url))
    return 0
