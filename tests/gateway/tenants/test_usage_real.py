"""Tenants' usage against real vLLM (the session's tiny engine), with the OpenAI SDK as the client.

Over a mixed run (chat and completions, streamed and not, streams that asked for usage and streams
that did not: the gateway asks for it hidden), the gateway's per-tenant counters equal what the
engine itself counted in the same seconds, tenant by tenant: vllm:prompt_tokens_total against
gateway_tenant_prompt_tokens_total, vllm:generation_tokens_total against completion tokens, and
vllm:prefix_cache_hits_total against cached prompt tokens (usage.prompt_tokens_details.cached_tokens;
the tiny profile sets --enable-prompt-tokens-details). A tenant over its requests budget gets 429
with Retry-After, and the SDK's own retry then succeeds against the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.http.seam import protocol_for
from server.gateway.settings import GatewaySettings
from tests.support import serve_in_thread, wait_for

pytestmark = pytest.mark.engine

KEYS = {"planner": "sk-planner-real", "articles": "sk-articles-real", "limited": "sk-limited-real"}
ENGINE_COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "completion": "vllm:generation_tokens_total",
    "cached": "vllm:prefix_cache_hits_total",
}
GATEWAY_COUNTERS = {
    "prompt": "gateway_tenant_prompt_tokens_total",
    "completion": "gateway_tenant_completion_tokens_total",
    "cached": "gateway_tenant_cached_prompt_tokens_total",
}
# Several 128-token blocks of the tiny tokenizer: each tenant's repeats hit its cached system prompt.
HOUSE = "You are the {} desk. Answer with care, cite what you use, never guess a price or a date. "


def samples(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def engine_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {what: samples(text, name) for what, name in ENGINE_COUNTERS.items()}


@pytest.fixture
def tenant_gateway(real_engine) -> Iterator[tuple[str, Any]]:
    settings = GatewaySettings.model_validate(
        {
            "models": [{"name": real_engine.model, "urls": [real_engine.url]}],
            "health": {"interval": 0.5, "timeout": 10.0},
            "tenants": [
                {"name": "planner", "api_keys": [KEYS["planner"]], "priority": "interactive"},
                {"name": "articles", "api_keys": [KEYS["articles"]], "priority": "batch"},
                {
                    "name": "limited",
                    "api_keys": [KEYS["limited"]],
                    "limits": {"requests_per_minute": 1, "window_seconds": 10},
                },
            ],
        }
    )
    registry = CollectorRegistry()
    app = create_app(settings, plan_deployment(settings.models).served_models(), registry=registry)
    with serve_in_thread(app, http=protocol_for(settings)) as url:
        yield url, registry


def gateway_counts(url: str, tenant: str, model: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {what: samples(text, name, tenant=tenant, model=model) for what, name in GATEWAY_COUNTERS.items()}
    out["requests"] = samples(text, "gateway_tenant_requests_total", tenant=tenant, model=model)
    return out


def mixed_run(client: openai.OpenAI, model: str, tenant: str) -> int:
    """Chat and completions, streamed and not; the number of requests sent."""
    system = f"Run {uuid.uuid4().hex}. " + HOUSE.format(tenant) * 12  # new to the engine's cache: repeats hit
    sent = 0
    for i in range(2):
        chat = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        client.chat.completions.create(model=model, messages=chat, max_tokens=4)
        for _part in client.chat.completions.create(model=model, messages=chat, max_tokens=5, stream=True):
            pass  # no include_usage: the gateway asks the engine for it, hidden from the client
        stream = client.chat.completions.create(
            model=model, messages=chat, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        usage = [part.usage for part in stream if part.usage is not None]
        assert len(usage) == 1  # the client asked for it: exactly once, at the end
        client.completions.create(model=model, prompt=system + f"Item {i}:", max_tokens=4)
        for _part in client.completions.create(model=model, prompt=system + f"Note {i}:", max_tokens=6, stream=True):
            pass
        sent += 5
    return sent


def test_usage_counters_equal_the_engines_own_token_counts_over_a_mixed_run(real_engine, tenant_gateway):
    url, _ = tenant_gateway
    model = real_engine.model
    for tenant in ("planner", "articles"):
        before = engine_counts(real_engine.url)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120) as client:
            sent = mixed_run(client, model, tenant)

        def settled(tenant: str = tenant, sent: int = sent) -> bool:
            return gateway_counts(url, tenant, model)["requests"] == sent

        def shown(tenant: str = tenant) -> dict[str, float]:
            return gateway_counts(url, tenant, model)

        wait_for(settled, timeout=60, what=shown)
        engine = {what: after - before[what] for what, after in engine_counts(real_engine.url).items()}
        counted = gateway_counts(url, tenant, model)
        print(f"{tenant}: engine {engine}, gateway {counted}")
        assert engine["prompt"] > 0 and engine["completion"] > 0 and engine["cached"] > 0, engine
        for what in ("prompt", "completion", "cached"):
            assert counted[what] == engine[what], (tenant, what, counted, engine)


def test_a_tenant_over_quota_gets_429_and_the_sdks_retry_succeeds(real_engine, tenant_gateway):
    url, _ = tenant_gateway
    model = real_engine.model
    messages = [{"role": "user", "content": "hello"}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["limited"], max_retries=0, timeout=120) as client:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    response = refused.value.response
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(response.headers["retry-after"]) <= 10
    assert response.headers["x-ratelimit-limit-requests"] == "1"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["limited"], max_retries=3, timeout=120) as client:
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
        answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert raw.retries_taken >= 1  # it was refused first (the budget had not refilled) and waited
    # Every answer counted under its status: the first 200, the 429s, the retried 200.
    wait_for(
        lambda: gateway_counts(url, "limited", model)["requests"] == 3 + raw.retries_taken,
        timeout=60,
        what=lambda: gateway_counts(url, "limited", model),
    )
