"""Tenants through a real gateway and stand-in engines over sockets: keys to tenants, claims
ignored, 401/403, the model list per tenant, usage counted exactly (streams too), /admin/usage."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.config import SettingsError
from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from standin import count_chat_tokens
from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import wait_for

PLANNER, PLANNER_FROM_ENV, ARTICLES, ADMIN = "sk-planner", "sk-planner-2", "sk-articles", "sk-admin"


def tenant_settings(models: dict[str, list[str]], **extra: object):
    tenants = [
        {"name": "planner", "api_keys": [PLANNER], "api_keys_env": "PLANNER_KEYS", "priority": "interactive"},
        {"name": "articles", "api_keys": [ARTICLES], "priority": "batch", "models": ["standin"]},
    ]
    return fast_settings(models, tenants=tenants, auth={"admin_api_keys": [ADMIN]}, **extra)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_keys_map_to_tenants_and_claimed_tenants_or_priorities_are_ignored(engines, gateway):
    [engine] = engines(1)
    gw = gateway(tenant_settings({"standin": [engine.url]}), environ={"PLANNER_KEYS": PLANNER_FROM_ENV})
    claims = {"x-tenant": "planner", "x-priority": "interactive", "x-tenant-id": "planner"}
    body = chat_body(user="planner", priority=-100)
    answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={**bearer(ARTICLES), **claims}, timeout=30)
    assert answer.status_code == 200, answer.text
    sent = engine.stats()["last_request"]
    assert "priority" not in sent["body"] and sent["body"]["user"] == "planner"  # `user` is the client's own
    assert not {"x-tenant", "x-priority", "x-tenant-id", "authorization"} & {k.lower() for k in sent["headers"]}
    for key in (PLANNER, PLANNER_FROM_ENV):
        ok = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=bearer(key), timeout=30)
        assert ok.status_code == 200, ok.text

    def counted() -> bool:
        return (
            gw.metric("gateway_tenant_requests_total", tenant="articles", model="standin", code="200") == 1
            and gw.metric("gateway_tenant_requests_total", tenant="planner", model="standin", code="200") == 2
        )

    wait_for(counted, timeout=30, what=lambda: httpx.get(f"{gw.url}/metrics").text[-3000:])


def test_unknown_keys_401_admin_keys_serve_no_model_traffic_and_a_model_not_allowed_is_403(engines, gateway):
    [standin] = engines(1)
    [other] = engines(1, model="other")
    gw = gateway(
        tenant_settings({"standin": [standin.url], "other": [other.url]}), environ={"PLANNER_KEYS": PLANNER_FROM_ENV}
    )
    url = f"{gw.url}/v1/chat/completions"
    for headers in ({}, bearer("sk-nobody"), bearer(ADMIN), bearer(PLANNER[:-1])):
        refused = httpx.post(url, json=chat_body(), headers=headers, timeout=30)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert PLANNER not in refused.text and ADMIN not in refused.text
    denied = httpx.post(url, json=chat_body(model="other"), headers=bearer(ARTICLES), timeout=30)
    assert denied.status_code == 403
    assert denied.json()["error"] == {
        "message": "Tenant `articles` may not use the model `other`.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    assert denied.headers["x-request-id"]
    # A name nobody serves is 403 too for a tenant with an allow-list: the answer lists no other model.
    unknown = httpx.post(url, json=chat_body(model="secret"), headers=bearer(ARTICLES), timeout=30)
    assert unknown.status_code == 403 and "other" not in unknown.text
    assert other.stats()["started"] == 0
    allowed = httpx.post(url, json=chat_body(model="other"), headers=bearer(PLANNER), timeout=30)
    assert allowed.status_code == 200, allowed.text

    listed = httpx.get(f"{gw.url}/v1/models", headers=bearer(ARTICLES), timeout=30)
    assert [card["id"] for card in listed.json()["data"]] == ["standin"]
    every = httpx.get(f"{gw.url}/v1/models", headers=bearer(PLANNER), timeout=30)
    assert sorted(card["id"] for card in every.json()["data"]) == ["other", "standin"]
    card = httpx.get(f"{gw.url}/v1/models/other", headers=bearer(ARTICLES), timeout=30)
    assert card.status_code == 403 and card.json()["error"]["code"] == "model_not_allowed"
    assert httpx.get(f"{gw.url}/v1/models", headers=bearer(ADMIN), timeout=30).status_code == 401
    assert httpx.get(f"{gw.url}/v1/models", timeout=30).status_code == 401


def test_usage_counters_equal_the_engines_own_token_counts_over_a_mixed_run(engines, gateway):
    [engine] = engines(1, prompt_tokens_details=True, tokens=6)
    gw = gateway(tenant_settings({"standin": [engine.url]}), environ={"PLANNER_KEYS": PLANNER_FROM_ENV})
    system = {"role": "system", "content": " ".join(f"word{i}" for i in range(64))}  # whole prefix blocks
    runs = [  # (key, stream, include_usage, max_tokens)
        (PLANNER, False, None, None), (PLANNER, True, None, 3), (PLANNER, True, True, None),
        (ARTICLES, False, None, 2), (ARTICLES, True, None, None), (PLANNER, True, False, 4),
    ]  # fmt: skip
    hits_before = engine.app.prefix_cache.hits
    expected: dict[str, dict[str, int]] = {t: {"prompt": 0, "completion": 0} for t in ("planner", "articles")}
    for index, (key, stream, include_usage, max_tokens) in enumerate(runs):
        messages = [system, {"role": "user", "content": f"question number {index}"}]
        body = {"model": "standin", "messages": messages, "stream": stream}
        if include_usage is not None:
            body["stream_options"] = {"include_usage": include_usage}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=bearer(key), timeout=30)
        assert answer.status_code == 200, answer.text
        tenant = "planner" if key == PLANNER else "articles"
        generated = min(6, max_tokens or 6)  # the stand-in's rule: its `tokens`, capped by max_tokens
        if stream:  # one content chunk per token the engine generated
            chunks = [e for e in sse_events(answer.text) if '"content":"' in e and '"content":""' not in e]
            assert len(chunks) == generated
        else:
            assert answer.json()["usage"]["completion_tokens"] == generated
        expected[tenant]["prompt"] += count_chat_tokens(messages, True)
        expected[tenant]["completion"] += generated
    cached = engine.app.prefix_cache.hits - hits_before
    assert cached > 0  # the shared system prompt hit from the second request on

    def counted(tenant: str, what: str) -> float:
        return gw.metric(f"gateway_tenant_{what}_total", tenant=tenant, model="standin")

    def settled() -> bool:
        return sum(counted(t, "requests") for t in expected) == len(runs)

    wait_for(settled, timeout=30, what=lambda: httpx.get(f"{gw.url}/metrics").text[-3000:])
    for tenant, figures in expected.items():
        assert counted(tenant, "prompt_tokens") == figures["prompt"], tenant
        assert counted(tenant, "completion_tokens") == figures["completion"], tenant
    assert sum(counted(t, "cached_prompt_tokens") for t in expected) == cached


@pytest.mark.one_process("the usage ledger behind /admin/usage is per gateway process")
def test_admin_usage_per_tenant_and_model_since_a_time_behind_the_admin_key(engines, gateway):
    [engine] = engines(1, prompt_tokens_details=True)
    gw = gateway(tenant_settings({"standin": [engine.url]}), environ={"PLANNER_KEYS": PLANNER_FROM_ENV})
    started = time.time()
    for key, stream in ((PLANNER, False), (PLANNER, True), (ARTICLES, True)):
        body = chat_body(stream=stream, max_tokens=2)
        assert (
            httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=bearer(key), timeout=30).status_code == 200
        )
    httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="nope"), headers=bearer(ARTICLES), timeout=30)

    def report(**params: str) -> httpx.Response:
        return httpx.get(f"{gw.url}/admin/usage", params=params, headers=bearer(ADMIN), timeout=30)

    def rows() -> dict[tuple[str, str], dict]:
        return {(row["tenant"], row["model"]): row for row in report().json()["data"]}

    wait_for(lambda: sum(sum(r["requests"].values()) for r in rows().values()) == 4, timeout=30, what=rows)
    data = rows()
    assert sorted(data) == [("articles", "_unknown"), ("articles", "standin"), ("planner", "standin")]
    planner = data["planner", "standin"]
    assert planner["requests"] == {"200": 2} and planner["completion_tokens"] == 4
    assert planner["prompt_tokens"] == 2 * count_chat_tokens(chat_body()["messages"], True)
    assert data["articles", "standin"]["requests"] == {"200": 1}
    assert data["articles", "_unknown"]["requests"] == {"403": 1}  # a model outside its list, under no model
    later = report(since=str(started + 120)).json()
    assert later["data"] == [] and later["scope"] == "process"
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started - 60))
    assert len(report(since=iso).json()["data"]) == 3
    bad = report(since="yesterday")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    for headers in ({}, bearer(PLANNER)):
        assert httpx.get(f"{gw.url}/admin/usage", headers=headers, timeout=30).status_code == 401


def test_without_tenants_there_is_no_admin_usage_route(engines, gateway):
    [engine] = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    assert httpx.get(f"{gw.url}/admin/usage", timeout=30).status_code == 404
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=30).status_code == 200
    text = httpx.get(f"{gw.url}/metrics", timeout=30).text
    assert "\ngateway_tenant_requests_total{" not in text  # the family is there, with no sample


def test_a_malformed_tenants_config_is_refused_with_the_file_and_the_key(tmp_path):
    from server.gateway.settings import load_settings

    config = tmp_path / "gateway.yaml"
    config.write_text(
        "tenants:\n  - name: planner\n    api_keys: [a]\n    limits: {requests_per_minut: 3}\n"
        "  - name: articles\n    priority: urgent\n"
    )
    with pytest.raises(SettingsError) as refused:
        load_settings(config)
    message = str(refused.value)
    assert str(config) in message
    assert "tenants.0.limits.requests_per_minut" in message
    assert "tenants.1.priority" in message
    config.write_text("tenants:\n  - name: planner\n    priority: batch\n")
    with pytest.raises(SettingsError, match=r"gateway.yaml: tenants.0: a tenant needs api_keys, api_keys_env or"):
        load_settings(config)

    config.write_text("tenants:\n  - name: planner\n    api_keys_env: NOT_SET_ANYWHERE\n")
    settings = load_settings(config)
    models = plan_deployment(settings.models).served_models()
    with pytest.raises(SettingsError) as unset:
        create_app(settings, models, registry=CollectorRegistry(), environ={})
    assert str(unset.value) == f"{config}: tenants.0 (planner).api_keys_env: $NOT_SET_ANYWHERE is not set"

    config.write_text(
        "auth: {admin_api_keys: [k]}\ntenants:\n  - name: a\n    api_keys: [k]\n"
    )  # an admin key as a tenant's
    with pytest.raises(SettingsError, match=r"tenants.0 \(a\): one of its API keys is also a key of the admin keys"):
        create_app(load_settings(config), [], registry=CollectorRegistry(), environ={})
    config.write_text("tenants:\n  - name: a\n    api_keys: [k]\n")
    with pytest.raises(SettingsError, match="auth keys are configured too"):
        create_app(load_settings(config), [], registry=CollectorRegistry(), environ={"GATEWAY_API_KEYS": "x"})
    config.write_text("tenants: []\n")
    with pytest.raises(SettingsError, match="tenants"):
        load_settings(config)
