"""The gateway's per-tenant counters, `gateway_tenant_*` (a part of observability.metrics).

Requests by status, prompt, cached prompt and completion tokens, labelled by tenant and model;
counted only when the gateway has tenants. Tenant names come from the config and models are capped
by GatewayMetrics (MAX_MODELS), so the label sets stay bounded. Several processes: as every
family of GatewayMetrics (the registry is None and the multiprocess files are the truth).
"""

from __future__ import annotations

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
        self._children: dict[tuple[str, str], tuple[Counter, Counter, Counter]] = {}
        self._by_code: dict[tuple[str, str, int], Counter] = {}

    def count(self, tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None:
        children = self._children.get((tenant, model))
        if children is None:
            children = self._children[tenant, model] = (
                self.prompt.labels(tenant, model),
                self.cached.labels(tenant, model),
                self.completion.labels(tenant, model),
            )
        requests = self._by_code.get((tenant, model, status))
        if requests is None:
            requests = self._by_code[tenant, model, status] = self.requests.labels(tenant, model, str(status))
        requests.inc()
        for counter, amount in zip(children, (prompt, cached, completion)):
            if amount > 0:
                counter.inc(amount)
