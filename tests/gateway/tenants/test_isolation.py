"""cache_isolation: tenant (server.gateway.tenants.isolation): the salt's derivation, the body the
engine gets (the tenant's salt set, the client's dropped), refusals at start (a malformed value,
no secret), and, through a real gateway and stand-in engines (one worker and two), the salt in
what engines get and nowhere else: not in logs, answers, /metrics or /admin/usage. What vLLM
does with the salt is in test_isolation_engine.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.config import SettingsError
from server.gateway.settings import GatewaySettings, load_settings
from server.gateway.tenants.isolation import (
    MIN_SECRET_CHARS,
    SALTED_ENDPOINTS,
    CacheSalts,
    load_cache_salts,
    tenant_salt,
)
from tests.gateway.conftest import chat_body, fast_settings

ROOT = Path(__file__).resolve().parents[3]
SECRET = "0123456789abcdef" * 4
PLANNER, ARTICLES, SHARED, ADMIN = "sk-planner", "sk-articles", "sk-shared", "sk-admin"


def isolated_settings(models: dict[str, list[str]], **extra: object) -> GatewaySettings:
    tenants = [
        {"name": "planner", "api_keys": [PLANNER], "cache_isolation": "tenant"},
        {"name": "articles", "api_keys": [ARTICLES], "cache_isolation": "tenant"},
        {"name": "shared", "api_keys": [SHARED]},
    ]
    return fast_settings(models, tenants=tenants, auth={"admin_api_keys": [ADMIN]}, **extra)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# -- the salt --------------------------------------------------------------------------------------


def test_a_salt_is_the_hmac_of_the_tenant_under_the_secret_and_fits_vllms_rules():
    a, b = tenant_salt(SECRET.encode(), "planner"), tenant_salt(SECRET.encode(), "articles")
    assert a == tenant_salt(SECRET.encode(), "planner")  # every worker and replica derives the same
    assert a != b and a != tenant_salt(b"another secret of enough length!!", "planner")
    # vLLM 0.32 (vllm/entrypoints/generate/base/protocol.py validate_cache_salt): a non-empty
    # string of at most 128 characters without '@', '/', '\\' or NUL.
    assert 0 < len(a) <= 128 and not set(a) & set("@/\\\x00")
    assert SECRET not in a and "planner" not in a


def test_the_body_an_isolated_tenant_sends_gets_its_salt_and_loses_the_clients():
    salts = CacheSalts({"planner": "s" * 64})
    body = {"model": "m", "messages": [], "cache_salt": "chosen-by-the-client"}
    for endpoint in SALTED_ENDPOINTS:
        assert salts.body_for("planner", endpoint, body) == {**body, "cache_salt": "s" * 64}
        assert salts.body_for("planner", endpoint, {"model": "m"}) == {"model": "m", "cache_salt": "s" * 64}
        assert salts.body_for("planner", endpoint, {"cache_salt": "s" * 64}) is None  # already so: unchanged
    for endpoint in ("tokenize", "detokenize", "messages_count_tokens", "embed_v2"):
        assert salts.body_for("planner", endpoint, body) == {"model": "m", "messages": []}
        assert salts.body_for("planner", endpoint, {"model": "m"}) is None
    assert salts.body_for("shared", "chat", body) is None  # a shared tenant's salt is its own business
    assert "s" * 64 not in repr(salts) and "planner" in repr(salts)


def test_salts_are_derived_only_for_isolated_tenants_and_need_the_secret(tmp_path):
    settings = isolated_settings({"m": ["http://127.0.0.1:9"]})
    salts = load_cache_salts(settings, {"GATEWAY_SALT_SECRET": SECRET})
    assert salts is not None
    assert salts.isolated("planner") and salts.isolated("articles") and not salts.isolated("shared")
    assert salts.body_for("planner", "chat", {})["cache_salt"] == tenant_salt(SECRET.encode(), "planner")  # type: ignore[index]
    shared_only = fast_settings({"m": ["http://127.0.0.1:9"]}, tenants=[{"name": "t", "api_keys": ["k"]}])
    assert load_cache_salts(shared_only, {}) is None  # nobody isolated: no secret needed
    assert load_cache_salts(fast_settings({"m": ["http://127.0.0.1:9"]}), {}) is None  # no tenants at all
    named = settings.model_copy(update={"tenant_salt_secret_env": "MY_SALT"})
    assert load_cache_salts(named, {"MY_SALT": SECRET}) is not None


@pytest.mark.parametrize(
    ("environ", "why"),
    [
        ({}, "is not set"),
        ({"GATEWAY_SALT_SECRET": "  "}, "is not set"),
        ({"GATEWAY_SALT_SECRET": "x" * (MIN_SECRET_CHARS - 1)}, f"holds fewer than {MIN_SECRET_CHARS} characters"),
    ],
)
def test_an_isolated_tenant_without_a_secret_is_refused_naming_the_file_and_the_setting(tmp_path, environ, why):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "models:\n  - name: m\n    urls: [http://127.0.0.1:9]\n"
        "tenants:\n  - name: planner\n    api_keys: [k]\n    cache_isolation: tenant\n"
    )
    with pytest.raises(SettingsError) as refused:
        load_cache_salts(load_settings(config), environ)
    message = str(refused.value)
    assert message.startswith(f"{config}: tenant_salt_secret_env: $GATEWAY_SALT_SECRET {why}")
    assert "planner" in message and "every gateway worker and replica" in message
    assert "x" * (MIN_SECRET_CHARS - 1) not in message


def test_a_malformed_cache_isolation_is_refused_at_start_with_the_file_and_the_key(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("tenants:\n  - name: planner\n    api_keys: [k]\n    cache_isolation: per-tenant\n")
    with pytest.raises(SettingsError) as refused:
        load_settings(config)
    assert str(refused.value).startswith(f"{config}: tenants.0.cache_isolation: Input should be 'shared' or 'tenant'")
    config.write_text("tenants:\n  - name: planner\n    api_keys: [k]\n    cache_isolation: [tenant]\n")
    with pytest.raises(SettingsError, match=r"gateway.yaml: tenants.0.cache_isolation: "):
        load_settings(config)
    config.write_text("tenant_salt_secret_env: [A]\n")
    with pytest.raises(SettingsError, match=r"gateway.yaml: tenant_salt_secret_env: Input should be a valid string"):
        load_settings(config)


def test_serve_refuses_an_isolated_tenant_without_the_secret_before_any_worker_starts(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "models:\n  - name: m\n    urls: [http://127.0.0.1:9]\n"
        "tenants:\n  - name: planner\n    api_keys: [k]\n    cache_isolation: tenant\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_SALT_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--config", str(config), "--workers", "2"],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{config}: tenant_salt_secret_env: $GATEWAY_SALT_SECRET is not set" in done.stderr
    assert "restart" not in done.stdout + done.stderr


# -- through a gateway -----------------------------------------------------------------------------


def test_engines_get_the_tenants_salt_and_never_the_clients_and_it_is_shown_nowhere(engines, gateway, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    [engine] = engines(1)
    gw = gateway(isolated_settings({"standin": [engine.url]}), environ={"GATEWAY_SALT_SECRET": SECRET})
    planner, articles = tenant_salt(SECRET.encode(), "planner"), tenant_salt(SECRET.encode(), "articles")
    seen: list[str] = []

    def sent(key: str, path: str, body: dict[str, object]) -> dict[str, object]:
        answer = httpx.post(f"{gw.url}{path}", json=body, headers=bearer(key), timeout=30)
        assert answer.status_code == 200, answer.text
        seen.append(answer.text + str(answer.headers))
        return engine.stats()["last_request"]["body"]

    chat = chat_body(cache_salt="the-client-s-own")
    assert sent(PLANNER, "/v1/chat/completions", chat)["cache_salt"] == planner
    assert sent(ARTICLES, "/v1/chat/completions", chat)["cache_salt"] == articles
    assert sent(PLANNER, "/v1/completions", {"model": "standin", "prompt": "hi"})["cache_salt"] == planner
    streamed = sent(ARTICLES, "/v1/chat/completions", chat_body(stream=True, cache_salt="mine"))
    assert streamed["cache_salt"] == articles
    assert sent(SHARED, "/v1/chat/completions", chat)["cache_salt"] == "the-client-s-own"  # shared: its own
    assert "cache_salt" not in sent(SHARED, "/v1/chat/completions", chat_body())
    # An invalid request the engine refuses: its error does not carry the salt either.
    refused = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "standin"}, headers=bearer(PLANNER))
    seen.append(refused.text + str(refused.headers))
    seen.append(httpx.get(f"{gw.url}/metrics", timeout=30).text)
    seen.append(httpx.get(f"{gw.url}/admin/usage", headers=bearer(ADMIN), timeout=30).text)
    logs = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    logs += "".join(path.read_text(errors="replace") for path in tmp_path.glob("gateway-*.log"))  # --workers 2
    assert gw.workers == 1 or '"tenant": "planner"' in logs or '"tenant":"planner"' in logs  # the log was read
    for salt in (planner, articles, SECRET):
        assert all(salt not in text for text in seen)
        assert salt not in logs
