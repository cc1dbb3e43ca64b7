"""Who is calling: the tenant an API key belongs to, and what that tenant may do.

The key alone says who calls: nothing the client sends besides it (an `x-tenant` header, a
`user` field) is read. A presented key is looked up in a dict of the keys (one lookup whatever
the number of keys: comparing with each of 200 keys costs ~0.2 ms a request), then compared with
the key found in constant time (`hmac.compare_digest`). How long the lookup takes depends on the
key's hash (Python's SipHash, seeded at random per process) and on the stored keys with the same
full hash, which a wrong key has with odds of 2**-64: it says nothing about how much of a real
key a guess shares. (Until 2026-12 the lookup hashed the key with SHA-256 first: the same
property, and at one request at a time the slowest part of it, ~20 us with its code out of the
CPU's caches: docs/configure/tenants.md, "What it costs".) Keys stay bytes in memory and appear
nowhere else: not in logs, not in errors, not in what engines are sent.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.gateway.request.request import output_cap
from server.gateway.settings import QuotaStore, Tenant
from server.gateway.tenants.counters import CounterStore, open_store
from server.gateway.tenants.errors import ModelNotAllowed
from server.gateway.tenants.quota import Clock, Headers, Quota, Ticket, reservation

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# Body fields a client could use to claim more than its tenant gives it: taken out of the body
# the engine gets (the priority of issue 32 comes from the tenant, never from the client).
CLAIMED_FIELDS = ("priority",)


@dataclass(slots=True)
class TenantRuntime:
    """One configured tenant while the gateway runs: its config and its quota."""

    config: Tenant
    quota: Quota | None  # None: no limits, nothing to count
    allowed: frozenset[str] | None = field(default=None)  # models it may use; None: all
    name: str = field(init=False)  # the config's (an attribute: read for every request)

    def __post_init__(self) -> None:
        self.name = self.config.name

    def may_use(self, model: str) -> bool:
        return self.allowed is None or model in self.allowed

    def admit(self, model: str, body: dict[str, Any], raw_length: int) -> tuple[Ticket | None, Headers]:
        """Refuse a model it may not use (ModelNotAllowed) or a request over quota (QuotaExceeded);
        else the quota's ticket (None without limits) and the answer's rate-limit headers."""
        if not self.may_use(model):
            raise ModelNotAllowed(self.name, model)
        if self.quota is None:
            return None, []
        return self.quota.admit(reservation(output_cap(body), raw_length))

    async def enter(self, model: str, body: dict[str, Any], raw_length: int) -> tuple[Ticket | None, Headers]:
        """`admit` over any counter store (Redis included). (The request path checks the allow-list
        before routing and asks `quota.enter` itself: app.proxied.)"""
        if not self.may_use(model):
            raise ModelNotAllowed(self.name, model)
        if self.quota is None:
            return None, []
        return await self.quota.enter(reservation(output_cap(body), raw_length))


def without_claims(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` without the fields a client may not set under a tenant, or None when it has none."""
    for name in CLAIMED_FIELDS:  # (a loop, not any() over a generator: this runs for every request)
        if name in body:
            return {k: v for k, v in body.items() if k not in CLAIMED_FIELDS}
    return None


class TenantDirectory:
    """Every tenant by its keys (see the module doc); built once at start."""

    def __init__(self, tenants: Iterable[tuple[Tenant, Sequence[bytes]]], clock: Clock | None = None) -> None:
        self.tenants: dict[str, TenantRuntime] = {}
        self.keys: list[bytes] = []
        self._by_key: dict[bytes, tuple[bytes, TenantRuntime]] = {}
        self.store: CounterStore | None = None  # after `start`; until then each quota counts in memory
        for config, keys in tenants:
            limits = config.limits
            limited = limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent
            quota = Quota(limits, clock or time.monotonic, key=config.name) if limited else None
            allowed = frozenset(config.models) if config.models is not None else None
            runtime = TenantRuntime(config, quota, allowed)
            self.tenants[config.name] = runtime
            for key in keys:
                self.keys.append(key)
                self._by_key[key] = (key, runtime)

    def find(self, key: bytes) -> TenantRuntime | None:
        """The tenant `key` belongs to, or None."""
        found = self._by_key.get(key)
        if found is None or not hmac.compare_digest(found[0], key):
            return None
        return found[1]

    def names(self) -> list[str]:
        return list(self.tenants)

    async def start(
        self, config: QuotaStore, environ: Mapping[str, str] | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        """Move the quotas onto the store `config` names (tenants.counters.open_store), before
        the first request; `registry` gets `gateway_quota_unchecked_total` (Redis only)."""
        quotas = [runtime.quota for runtime in self.tenants.values() if runtime.quota is not None]
        if not quotas:
            return  # nobody has limits: nothing to count, nothing to connect to
        self.store = await open_store(config, self.names(), os.environ if environ is None else environ, registry)
        for quota in quotas:
            quota.store = self.store

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()
            self.store = None
