"""The gateway's per-tenant counters, `gateway_tenant_*` (a part of observability.metrics).

Requests by status, prompt, cached prompt and completion tokens, labelled by tenant and model;
counted only when the gateway has tenants. Tenant names come from the config and models are capped
by GatewayMetrics (MAX_MODELS), so the label sets stay bounded. Several processes: as every
family of GatewayMetrics (the registry is None and the multiprocess files are the truth).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter


class TenantCounters:
    """`gateway_tenant_*`: requests by status and tokens, per tenant and model (only with tenants;
    tenant names come from the config and models are capped as above, so the labels stay bounded)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        labels = ["tenant", "model"]
        self.requests = Counter(
            "gateway_tenant_requests", "Requests answered, by tenant, model and HTTP status code.",
            [*labels, "code"], registry=registry,
        )  # fmt: skip
        self.prompt = Counter(
            "gateway_tenant_prompt_tokens", "Prompt tokens (engines' usage).", labels, registry=registry
        )
        self.cached = Counter(
            "gateway_tenant_cached_prompt_tokens",
            "Prompt tokens found in the engine's prefix cache (usage.prompt_tokens_details.cached_tokens).",
            labels, registry=registry,
        )  # fmt: skip
        self.completion = Counter(
            "gateway_tenant_completion_tokens", "Completion tokens (engines' usage).", labels, registry=registry
        )
        # The children's values themselves (as GatewayMetrics does: `Counter.inc` adds two checks
        # and a call a counter), looked up once per label set.
        self._values: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._by_code: dict[tuple[str, str, int], Any] = {}

    def count(self, tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None:
        values = self._values.get((tenant, model))
        if values is None:
            values = self._values[tenant, model] = (
                self.prompt.labels(tenant, model)._value,
                self.cached.labels(tenant, model)._value,
                self.completion.labels(tenant, model)._value,
            )
        requests = self._by_code.get((tenant, model, status))
        if requests is None:
            requests = self._by_code[tenant, model, status] = self.requests.labels(tenant, model, str(status))._value
        requests.inc(1)
        if prompt > 0:  # (counters only go up: callers pass sane counts, 0 when the engine said nothing)
            values[0].inc(prompt)
        if cached > 0:
            values[1].inc(cached)
        if completion > 0:
            values[2].inc(completion)
