"""Who calls: a key to its tenant (by digest, then compared in constant time), the allow-list, the body
fields a client may not claim (server.gateway.tenants.directory)."""

from __future__ import annotations

import pytest

from server.gateway.settings import Tenant
from server.gateway.tenants.directory import TenantDirectory, without_claims
from server.gateway.tenants.errors import ModelNotAllowed


def tenant(name: str, **fields: object) -> Tenant:
    return Tenant.model_validate({"name": name, "api_keys": ["x"], **fields})


def test_only_the_whole_key_finds_its_tenant():
    directory = TenantDirectory([(tenant("a"), [b"sk-a"]), (tenant("b"), [b"sk-b", b"sk-bb"])])
    assert directory.find(b"sk-bb").name == "b"
    for guess in (b"sk-", b"sk-b ", b"sk-bbb", b"", b"SK-A", b"sk-a\x00"):
        assert directory.find(guess) is None, guess
    assert TenantDirectory([]).find(b"sk-a") is None


def test_each_key_finds_its_own_tenant():
    directory = TenantDirectory([(tenant("planner"), [b"k1", b"k2"]), (tenant("articles"), [b"k3"])])
    assert directory.find(b"k1").name == "planner"
    assert directory.find(b"k2").name == "planner"
    assert directory.find(b"k3").name == "articles"
    assert directory.find(b"k4") is None
    assert directory.keys == [b"k1", b"k2", b"k3"]
    assert directory.names() == ["planner", "articles"]


def test_a_tenant_without_limits_has_no_quota_and_admits_without_headers():
    directory = TenantDirectory([(tenant("open"), [b"k"])])
    runtime = directory.tenants["open"]
    assert runtime.quota is None
    assert runtime.admit("any", {}, 100) == (None, [])


def test_the_allow_list_refuses_other_models_with_model_not_allowed():
    directory = TenantDirectory([(tenant("planner", models=["tiny", "tiny-lora"]), [b"k"])])
    runtime = directory.tenants["planner"]
    assert runtime.may_use("tiny") and runtime.may_use("tiny-lora")
    with pytest.raises(ModelNotAllowed) as refused:
        runtime.admit("big", {}, 10)
    assert refused.value.status == 403 and refused.value.code == "model_not_allowed"
    assert refused.value.param == "model"


def test_a_limited_tenant_gets_a_quota_and_its_headers():
    directory = TenantDirectory([(tenant("t", limits={"requests_per_minute": 5}), [b"k"])], clock=lambda: 0.0)
    ticket, headers = directory.tenants["t"].admit("m", {}, 10)
    assert ticket is not None and dict(headers)[b"x-ratelimit-remaining-requests"] == b"4"


def test_the_claimed_priority_is_taken_out_and_nothing_else():
    assert without_claims({"model": "m", "user": "someone"}) is None  # `user` is the client's, not a tenant
    assert without_claims({"model": "m", "priority": -100, "user": "u"}) == {"model": "m", "user": "u"}
