"""`python -m server tenants --url` against a real gateway (stand-in engines over sockets): the live
usage it prints is the gateway's own /admin/usage, and a wrong admin key or a gateway without
tenants is said plainly, without the key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from server.cli import main as cli_main
from tests.gateway.conftest import chat_body, fast_settings
from tests.support import wait_for

PLANNER, ARTICLES, ADMIN = "sk-planner-op", "sk-articles-op", "sk-admin-op"
TENANTS = [
    {"name": "planner", "api_keys": [PLANNER], "priority": "interactive", "limits": {"requests_per_minute": 600}},
    {"name": "articles", "api_keys": [ARTICLES], "priority": "batch", "models": ["standin"]},
]

pytestmark = pytest.mark.one_process("the usage ledger behind /admin/usage is per gateway process")


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": TENANTS}))
    return path


def ask(url: str, key: str, **body: object) -> None:
    headers = {"authorization": f"Bearer {key}"}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat_body(**body), headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text


def usage(url: str) -> list[dict]:
    got = httpx.get(f"{url}/admin/usage", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    rows: list[dict] = got.json()["data"]
    return rows


def test_the_live_usage_is_the_gateways_own(engines, gateway, tmp_path, capsys, monkeypatch):
    [engine] = engines(1, prompt_tokens_details=True)
    gw = gateway(fast_settings({"standin": [engine.url]}, tenants=TENANTS, auth={"admin_api_keys": [ADMIN]}))
    ask(gw.url, PLANNER, max_tokens=2)
    ask(gw.url, PLANNER, stream=True, max_tokens=3)
    ask(gw.url, ARTICLES, max_tokens=1)
    wait_for(lambda: sum(sum(r["requests"].values()) for r in usage(gw.url)) == 3, timeout=30, what=usage)
    monkeypatch.setenv("OPS_ADMIN_KEY", ADMIN)
    config = str(config_file(tmp_path))
    args = ["tenants", "--config", config, "--url", gw.url, "--admin-key-env", "OPS_ADMIN_KEY"]
    assert cli_main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["tenant"]: row for row in usage(gw.url)}
    by_name = {t["name"]: t for t in report["tenants"]}
    assert by_name["planner"]["usage"] == [rows["planner"]]
    assert by_name["articles"]["usage"] == [rows["articles"]]
    assert rows["planner"]["requests"] == {"200": 2} and rows["planner"]["completion_tokens"] == 5
    assert report["usage"]["scope"] == "process" and report["usage"]["other_tenants"] == []
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    planner = rows["planner"]
    assert (
        f"    standin: requests 200 x2; prompt tokens {planner['prompt_tokens']} "
        f"(cached {planner['cached_prompt_tokens']}), completion tokens 5"
    ) in out
    assert f"usage from {gw.url} since the process started" in out
    assert PLANNER not in out and ADMIN not in out
    assert cli_main([*args, "--since", "4102444800"]) == 0  # 2100-01-01: nothing yet
    assert out.count("no requests") == 0 and capsys.readouterr().out.count("no requests") == 2


def test_a_wrong_admin_key_or_a_tenant_key_is_refused_plainly(engines, gateway, tmp_path, capsys, monkeypatch):
    [engine] = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, tenants=TENANTS, auth={"admin_api_keys": [ADMIN]}))
    for wrong in ("sk-not-the-admin", PLANNER):
        monkeypatch.setenv("GATEWAY_ADMIN_KEYS", wrong)
        assert cli_main(["tenants", "--config", str(config_file(tmp_path)), "--url", gw.url]) == 1
        err = capsys.readouterr().err
        assert f"error: the gateway at {gw.url} answered 401: Incorrect API key provided." in err
        assert wrong not in err


def test_a_gateway_without_tenants_is_said_to_have_none(engines, gateway, tmp_path, capsys, monkeypatch):
    [engine] = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    monkeypatch.setenv("GATEWAY_ADMIN_KEYS", ADMIN)
    assert cli_main(["tenants", "--config", str(config_file(tmp_path)), "--url", gw.url]) == 1
    assert f"the gateway at {gw.url} has no /admin/usage: it runs without tenants" in capsys.readouterr().err
