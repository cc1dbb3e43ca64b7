"""`python -m server tenants` without a gateway: tenants, keys as fingerprints only, limits, and the
clear refusals (no admin key for --url, --since without --url, a gateway that is not there).
The live usage from a running gateway: tests/gateway/tenants/test_operator_cli.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import main as cli_main
from server.deploy.tenants_report import fingerprint
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[1]
IN_FILE, IN_ENV, WRITTEN = "sk-from-the-file-0001", "sk-from-the-env-0002", "sk-written-0003"


def config_with_tenants(tmp_path: Path) -> Path:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys/articles.txt").write_text(f"# the articles team\n{IN_FILE}\n")
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "tenants:\n"
        "  - name: planner\n"
        f"    api_keys: [{WRITTEN}]\n"
        "    api_keys_env: PLANNER_KEYS\n"
        "    priority: interactive\n"
        "    models: [tiny]\n"
        "    limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}\n"
        "    cache_isolation: tenant\n"
        "  - name: articles\n"
        "    api_keys_file: keys/articles.txt\n"
        "    api_keys_env: ARTICLES_KEYS\n"
        "    priority: batch\n"
    )
    return config


def test_a_fingerprint_is_the_start_of_the_keys_sha256_and_tells_keys_apart():
    assert fingerprint(IN_FILE) == "sha256:" + hashlib.sha256(IN_FILE.encode()).hexdigest()[:12]
    assert fingerprint(IN_FILE) != fingerprint(IN_ENV)


def test_tenants_are_listed_with_fingerprints_sources_and_limits_never_the_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLANNER_KEYS", f"{IN_ENV}, ")
    monkeypatch.delenv("ARTICLES_KEYS", raising=False)
    config = config_with_tenants(tmp_path)
    assert cli_main(["tenants", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    for key in (IN_FILE, IN_ENV, WRITTEN):
        assert key not in out
    assert f"2 tenants in {config}" in out
    assert "planner: priority interactive, models tiny, cache_isolation tenant" in out
    assert "  limits: 600 requests/min, 200000 tokens/min, 32 concurrent" in out
    assert f"  keys: {fingerprint(WRITTEN)} (the config), {fingerprint(IN_ENV)} ($PLANNER_KEYS)" in out
    assert "articles: priority batch, models all, cache_isolation shared" in out
    assert "  limits: none" in out
    assert f"  keys: {fingerprint(IN_FILE)} (keys/articles.txt)" in out
    assert "  not read: $ARTICLES_KEYS is not set here" in out


def test_json_output_has_the_same_facts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PLANNER_KEYS", raising=False)
    monkeypatch.delenv("ARTICLES_KEYS", raising=False)
    config = config_with_tenants(tmp_path)
    (tmp_path / "keys/articles.txt").unlink()
    assert cli_main(["tenants", "--config", str(config), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    planner, articles = report["tenants"]
    assert planner["keys"] == [{"fingerprint": fingerprint(WRITTEN), "source": "the config"}]
    assert planner["key_sources_missing"] == ["$PLANNER_KEYS is not set here"]
    assert planner["limits"] == {
        "requests_per_minute": 600,
        "tokens_per_minute": 200000,
        "max_concurrent": 32,
        "window_seconds": 60.0,
    }
    assert articles["keys"] == []
    assert articles["key_sources_missing"][0] == "$ARTICLES_KEYS is not set here"
    assert "keys/articles.txt: cannot read: No such file or directory" in articles["key_sources_missing"][1]
    assert planner["usage"] is None and "usage" not in report
    assert WRITTEN not in out


def test_a_config_without_tenants_says_so(tmp_path, capsys):
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n  - name: tiny\n    urls: [http://127.0.0.1:9]\n")
    assert cli_main(["tenants", "--config", str(config)]) == 0
    assert "no tenants" in capsys.readouterr().out


def test_a_malformed_config_is_refused_with_the_file_and_the_key(tmp_path, capsys):
    config = tmp_path / "gateway.yaml"
    config.write_text("tenants:\n  - name: planner\n    api_keys: [a]\n    priority: urgent\n")
    assert cli_main(["tenants", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "tenants.0.priority" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "http://127.0.0.1:9"], "error: --url needs an admin key of the gateway in $GATEWAY_ADMIN_KEYS"),
        (["--url", "http://127.0.0.1:9", "--admin-key-env", "OPS_KEY"], "in $OPS_KEY"),
        (["--since", "0"], "error: --since needs --url"),
    ],
    ids=["no-admin-key", "no-key-in-the-named-variable", "since-without-url"],
)
def test_a_usage_question_without_what_it_needs_is_refused(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.delenv("GATEWAY_ADMIN_KEYS", raising=False)
    monkeypatch.delenv("OPS_KEY", raising=False)
    assert cli_main(["tenants", "--config", str(config_with_tenants(tmp_path)), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_gateway_that_is_not_there_is_said_plainly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GATEWAY_ADMIN_KEYS", "sk-admin-secret")
    url = f"http://127.0.0.1:{free_port()}"
    assert cli_main(["tenants", "--config", str(config_with_tenants(tmp_path)), "--url", url]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot reach the gateway at {url}: ConnectError" in err
    assert "sk-admin-secret" not in err


def test_help_explains_fingerprints_and_where_the_admin_key_comes_from():
    done = subprocess.run(
        [sys.executable, "-m", "server", "tenants", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "fingerprints" in done.stdout and "$GATEWAY_ADMIN_KEYS" in done.stdout and "--admin-key-env" in done.stdout
    assert "never a key on the command line" in done.stdout
