"""Whose prefix cache is whose: vLLM's `cache_salt`, set by the gateway for each tenant with
`cache_isolation: tenant`, so that no other tenant can hit (or time) its cached blocks.

vLLM mixes a request's `cache_salt` into the hash of its prompt's first KV block, so prompts
with different salts never share a block (and every later block chains from the first). Hits
on a shared prefix cache can be told apart by timing from prompts of a few tokens
(CVE-2025-46570): a salt only protects if the client cannot choose it, so for such a tenant
the gateway drops a client's own `cache_salt` and sets its own.

A tenant's salt is HMAC-SHA256(secret, tenant name), in hex (64 characters: vLLM takes at most
128, without `@ / \\` or NUL). The secret comes from `$tenant_salt_secret_env`
(GATEWAY_SALT_SECRET), read once at start; without it a config with an isolated tenant is
refused (`load_cache_salts`), because a salt must be the same in every gateway worker and
replica: a secret drawn at random per start would split one tenant's cache across replicas
and empty it (in effect) at every restart. The salts are derived at start, so a request pays a
dict lookup and one more serialization of its body, not an HMAC.

Neither the secret nor a salt is logged, shown by /admin, or put in an answer: `CacheSalts`
has a repr without them; the prefix indexes key blocks by a digest of the salt
(server.gateway.replicas.blocks.namespace), never by the salt itself.

Which endpoints get the salt: those whose vLLM 0.32 request model has a `cache_salt` field
(checked against vllm/entrypoints/**/protocol.py): chat and text completions, chat batches,
Responses, Anthropic's Messages, generative scoring and the pooling family (embeddings,
pooling, classify, score, rerank). The others (tokenize, count_tokens, Cohere's /v2/embed,
audio) have no prefix cache to protect or no such field; a client's `cache_salt` is dropped
from them too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

from server.config import SettingsError
from server.gateway.settings import GatewaySettings

# Endpoint names (server.gateway.request.endpoints) whose vLLM request model takes `cache_salt`.
SALTED_ENDPOINTS = frozenset(
    {
        "chat",
        "completions",
        "chat_batch",
        "responses",
        "messages",
        "generative_scoring",
        "embeddings",
        "pooling",
        "classify",
        "score",
        "rerank",
    }
)
MIN_SECRET_CHARS = 32  # e.g. `openssl rand -hex 32` (64)


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The `cache_salt` of `tenant`: HMAC-SHA256 of its name under `secret`, in hex."""
    return hmac.new(secret, b"gateway cache_salt\x00" + tenant.encode(), hashlib.sha256).hexdigest()


class CacheSalts:
    """The salt of every tenant with `cache_isolation: tenant`, and the body its engine gets."""

    __slots__ = ("_salts",)

    def __init__(self, salts: Mapping[str, str]) -> None:
        self._salts = dict(salts)

    def __repr__(self) -> str:  # never the salts
        return f"CacheSalts(isolated={sorted(self._salts)})"

    def isolated(self, tenant: str) -> bool:
        return tenant in self._salts

    def body_for(self, tenant: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """What the engine is sent instead of `body` for `tenant` at `endpoint`, or None when
        `body` stands: a shared tenant's body is its own (its `cache_salt` too); an isolated
        tenant's gets its salt where vLLM takes one, and loses the client's everywhere."""
        salt = self._salts.get(tenant)
        if salt is None:
            return None
        if endpoint in SALTED_ENDPOINTS:
            return None if body.get("cache_salt") == salt else {**body, "cache_salt": salt}
        if "cache_salt" in body:
            return {k: v for k, v in body.items() if k != "cache_salt"}
        return None


def load_cache_salts(settings: GatewaySettings, environ: Mapping[str, str] | None = None) -> CacheSalts | None:
    """The salts of `settings`' isolated tenants (None when no tenant is isolated); SettingsError
    naming the config file and `tenant_salt_secret_env` when the secret is not set or too short."""
    isolated = [tenant.name for tenant in settings.tenants or () if tenant.cache_isolation == "tenant"]
    if not isolated:
        return None
    environ = os.environ if environ is None else environ
    name = settings.tenant_salt_secret_env
    secret = environ.get(name, "").strip()
    if len(secret) < MIN_SECRET_CHARS:
        where = str(settings.source) if settings.source else "the gateway config"
        state = "is not set" if not secret else f"holds fewer than {MIN_SECRET_CHARS} characters"
        raise SettingsError(
            f"{where}: tenant_salt_secret_env: ${name} {state}; tenants {', '.join(isolated)} have "
            f"cache_isolation: tenant, whose cache salts are derived from it. Set it to the same secret "
            f"in every gateway worker and replica (e.g. `openssl rand -hex 32`)"
        )
    key = secret.encode()
    return CacheSalts({tenant: tenant_salt(key, tenant) for tenant in isolated})
