"""The multi-tenant scenario: tenant specs, per-tenant and per-class reports, against a stand-in
engine over sockets (each tenant's key sent, 429s counted per class)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtest.multi_tenant import SpecError, TenantLoad, parse_slo, parse_tenant, render, run


def test_a_tenant_spec_parses_and_bad_ones_are_refused() -> None:
    load = parse_tenant("name=planner,key=env:K,class=interactive,shape=chat,turns=12,rate=0.5", {"K": "sk-1"})
    assert load == TenantLoad("planner", "sk-1", "interactive", "chat", rate=0.5, turns=12)
    assert "sk-1" not in repr(load)  # keys stay out of what is printed
    for bad in (
        "name=a",
        "key=x",
        "name=a,key=x,class=vip",
        "name=a,key=x,shape=storm",
        "name=a,key=x,rate=fast",
        "name=a,key=x,rate=-1",
        "name=a,key=x,colour=red",
        "name=a,key=env:MISSING",
        "name=a,key=x,junk",
    ):
        with pytest.raises(SpecError):
            parse_tenant(bad, {})
    assert parse_slo("2") == {"interactive": 2.0, "standard": 2.0, "batch": 2.0}
    assert parse_slo("interactive=1,batch=60") == {"interactive": 1.0, "batch": 60.0}
    with pytest.raises(SpecError):
        parse_slo("vip=1")


def test_each_tenant_sends_its_own_key_and_shape_and_the_report_counts_429s_per_class(standin) -> None:
    httpx.post(f"{standin}/_standin/faults", json={"status": 429, "times": 2}, timeout=5).raise_for_status()
    loads = [
        TenantLoad("planner", "sk-planner", "interactive", "chat", rate=0, requests=1, turns=3, max_tokens=4),
        TenantLoad("articles", "sk-articles", "batch", "batch", rate=0, requests=6, max_tokens=8, prompt_chars=400),
        TenantLoad("scraper", "sk-scraper", "batch", "unique", rate=50, requests=4, max_tokens=8, prompt_chars=400),
    ]
    result = asyncio.run(run(standin, "standin", loads, {"interactive": 30.0, "batch": 60.0}, timeout_s=60))
    tenants, classes = result["tenants"], result["classes"]
    assert set(tenants) == {"planner", "articles", "scraper"} and set(classes) == {"interactive", "batch"}
    total_429 = sum(t["rejected_429"] for t in tenants.values())
    assert total_429 == 2 == sum(c["rejected_429"] for c in classes.values())
    assert sum(t["ok"] for t in tenants.values()) + total_429 == sum(t["requests"] for t in tenants.values())
    assert classes["batch"]["requests"] == tenants["articles"]["requests"] + tenants["scraper"]["requests"]
    for tenant in tenants.values():
        if tenant["ok"]:
            assert tenant["ttft_s"]["p50"] > 0 and tenant["throughput_tokens_per_s"] > 0
            assert tenant["good"] == tenant["ok"]  # the stand-in answers far within the SLOs
    stats = httpx.get(f"{standin}/_standin/stats", timeout=5).json()
    keys = {stats["last_request"]["headers"].get("authorization")}
    assert keys <= {"Bearer sk-planner", "Bearer sk-articles", "Bearer sk-scraper"}
    assert "planner" in render(result) and "interactive" in render(result)
