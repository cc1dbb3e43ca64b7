"""Tenants in the compose and Helm renderers: keys reach the gateway by name, never in a rendered file.

A config with tenants (keys from a variable and from a file, `cache_isolation: tenant`, Redis for
the quotas) is rendered both ways; the rendered gateway config is loaded as the gateway loads it,
with the host's (compose) or the Secret's (Helm) values, and must give every tenant its keys.
A config that writes keys itself is refused, naming the file and the key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from server.cli import main as cli_main
from server.deploy import compose
from server.deploy.gateway_service import REDIS_IMAGE, REDIS_URL
from server.deploy.helm import KEYS_SECRET
from server.deploy.secrets import KEYS_IN_POD
from server.gateway.app.auth import load_tenants
from server.gateway.settings import load_settings

from .conftest import ROOT
from .test_dclint import DCLINT, dclint
from .test_helm import KUBERNETES_VERSIONS, named, render, values_for

PLANNER_KEY = "sk-planner-never-in-a-rendered-file-0001"
ARTICLES_KEY = "sk-articles-never-in-a-rendered-file-0002"
TENANTS = """\
tenants:
  - name: planner
    api_keys_env: PLANNER_KEYS
    priority: interactive
    models: [tiny]
    limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrent: 32}
    cache_isolation: tenant
  - name: articles
    api_keys_file: keys/articles.txt
    priority: batch
quota_store:
  backend: redis
"""


def checkout(tmp_path: Path, tenants: str = TENANTS) -> Path:
    """A checkout's layout (configs/ beside docker/) with the tiny CPU profile and a tenants config."""
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "configs/profiles", configs / "profiles")
    (configs / "keys").mkdir()
    (configs / "keys/articles.txt").write_text(f"# the articles team\n{ARTICLES_KEY}\n")
    config = configs / "gateway.yaml"
    config.write_text("models:\n  - name: tiny\n    profile: profiles/tiny-cpu.yaml\n" + tenants)
    return config


def rendered_compose(config: Path) -> dict[Path, str]:
    output = config.parent.parent / "docker/compose.yaml"
    output.parent.mkdir(exist_ok=True)
    files = compose.render_files(load_settings(config).models, config=config, output=output)
    for path, text in files.items():
        path.write_text(text)
    return files


def test_compose_passes_tenants_keys_by_name_and_the_gateway_loads_them(tmp_path):
    config = checkout(tmp_path)
    files = rendered_compose(config)
    for path, text in files.items():
        assert PLANNER_KEY not in text and ARTICLES_KEY not in text, path
    services = yaml.safe_load(files[tmp_path / "docker/compose.yaml"])["services"]
    gateway = services["gateway"]
    env = gateway["environment"]
    # Passed through from the host by name; with tenants no `auth` keys beside them.
    assert {name: env[name] for name in ("PLANNER_KEYS", "GATEWAY_ADMIN_KEYS", "GATEWAY_SALT_SECRET")} == {
        "PLANNER_KEYS": None,
        "GATEWAY_ADMIN_KEYS": None,
        "GATEWAY_SALT_SECRET": None,
    }
    assert "GATEWAY_API_KEYS" not in env
    assert env["GATEWAY_REDIS_URL"] == f"${{GATEWAY_REDIS_URL:-{REDIS_URL}}}"
    # The quota store: this file's Redis, healthy before the gateway starts.
    assert services["redis"]["image"] == REDIS_IMAGE
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert gateway["depends_on"]["redis"] == {"condition": "service_healthy"}
    # The gateway's config, read where the container reads it: docker/gateway.yaml beside ../configs.
    settings = load_settings(tmp_path / "docker/gateway.yaml")
    assert [t.api_keys_file for t in settings.tenants or ()] == [None, "../configs/keys/articles.txt"]
    assert settings.quota_store.backend == "redis"
    directory = load_tenants(settings, {"PLANNER_KEYS": PLANNER_KEY}, admin_keys=[])
    assert directory is not None
    assert directory.find(PLANNER_KEY.encode()).name == "planner"
    assert directory.find(ARTICLES_KEY.encode()).name == "articles"


def test_without_tenants_compose_keeps_the_auth_keys_and_adds_no_redis(tmp_path):
    config = checkout(tmp_path, tenants="")
    services = yaml.safe_load(rendered_compose(config)[tmp_path / "docker/compose.yaml"])["services"]
    assert services["gateway"]["environment"] == {"GATEWAY_API_KEYS": None, "GATEWAY_ADMIN_KEYS": None}
    assert "redis" not in services


@pytest.mark.skipif(shutil.which("node") is None or not DCLINT.exists(), reason="dclint needs node and its install")
def test_the_tenants_compose_file_passes_dclint(tmp_path):
    config = checkout(tmp_path)
    rendered_compose(config)
    (report,) = dclint(tmp_path / "docker/compose.yaml")
    problems = [f"{m['line']}: {m['type']} {m['rule']}: {m['message']}" for m in report["messages"]]
    assert not problems, problems


LITERAL = [
    (
        "tenants:\n  - name: planner\n    api_keys: [sk-literal]\n",
        "tenants.0 (planner).api_keys: keys written in the config would be copied into",
    ),
    (
        "auth:\n  admin_api_keys: [sk-admin-literal]\ntenants:\n  - name: planner\n    api_keys_env: PLANNER_KEYS\n",
        "auth.admin_api_keys: keys written in the config would be copied into",
    ),
]


@pytest.mark.parametrize(("tenants", "message"), LITERAL, ids=["tenant-keys", "admin-keys"])
@pytest.mark.parametrize("command", ["compose", "helm-values"])
def test_keys_written_in_the_config_are_refused_with_the_file_and_the_key(tmp_path, capsys, tenants, message, command):
    config = checkout(tmp_path, tenants)
    output = tmp_path / ("docker/compose.yaml" if command == "compose" else "values.yaml")
    output.parent.mkdir(exist_ok=True)
    assert cli_main([command, "--config", str(config), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: {message}" in err, err
    assert "sk-literal" not in err and "sk-admin-literal" not in err
    assert not output.exists()


def test_compose_refuses_a_key_file_the_container_cannot_see(tmp_path, capsys):
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("sk-x\n")
    config = checkout(tmp_path, f"tenants:\n  - name: planner\n    api_keys_file: {outside}\n")
    (tmp_path / "docker").mkdir()
    assert cli_main(["compose", "--config", str(config), "--output", str(tmp_path / "docker/compose.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"tenants.0 (planner).api_keys_file: {outside} is outside {tmp_path / 'configs'}" in err


# -- Helm -----------------------------------------------------------------------------------------


def test_helm_values_name_the_keys_secret_and_the_chart_reads_every_key_from_it(tmp_path):
    config = checkout(tmp_path)
    values = values_for(config)
    text = yaml.safe_dump(values)
    assert PLANNER_KEY not in text and ARTICLES_KEY not in text
    assert values["gateway"]["keysSecret"] == KEYS_SECRET
    tenants = values["gateway"]["config"]["tenants"]
    assert tenants[1]["api_keys_file"] == f"{KEYS_IN_POD}/articles.txt"
    objects = render(values)
    deployment = named(objects, "Deployment", "llm-llm-serving-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    for name in ("PLANNER_KEYS", "GATEWAY_SALT_SECRET", "GATEWAY_REDIS_URL"):
        assert env[name] == {"name": KEYS_SECRET, "key": name}, name
    assert env["GATEWAY_ADMIN_KEYS"] == {"name": KEYS_SECRET, "key": "GATEWAY_ADMIN_KEYS", "optional": True}
    assert {"name": "keys", "mountPath": KEYS_IN_POD, "readOnly": True} in container["volumeMounts"]
    assert {"name": "keys", "secret": {"secretName": KEYS_SECRET, "defaultMode": 0o444}} in pod["volumes"]
    config_map = named(objects, "ConfigMap", "llm-llm-serving-gateway")["data"]["gateway.yaml"]
    assert PLANNER_KEY not in config_map and "api_keys:" not in config_map
    # The ConfigMap is a config the gateway loads; with the Secret's values it finds both tenants.
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "gateway.yaml").write_text(config_map)
    settings = load_settings(etc / "gateway.yaml")
    assert [t.name for t in settings.tenants or ()] == ["planner", "articles"]
    for version in (KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]):
        kubernetes_validate.validate(deployment, version, strict=True)


def test_helm_values_header_lists_what_the_secret_must_hold(tmp_path, capsys):
    config = checkout(tmp_path)
    assert cli_main(["helm-values", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert (
        f"# The Secret {KEYS_SECRET} must hold: PLANNER_KEYS, GATEWAY_SALT_SECRET, GATEWAY_REDIS_URL, articles.txt"
        in out
    )


def test_a_redis_url_without_a_password_is_a_plain_value(tmp_path):
    values = values_for(checkout(tmp_path))
    values["gateway"]["redisUrl"] = "redis://llm-redis:6379/0"
    (container,) = named(render(values), "Deployment", "llm-llm-serving-gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["GATEWAY_REDIS_URL"] == {"name": "GATEWAY_REDIS_URL", "value": "redis://llm-redis:6379/0"}


def test_without_tenants_the_gateway_pod_gets_no_keys_secret():
    values = values_for(ROOT / "configs/gateway.gpu.yaml")
    assert "keysSecret" not in values["gateway"]
    (container,) = named(render(values), "Deployment", "llm-llm-serving-gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    assert "env" not in container
    assert [m["name"] for m in container["volumeMounts"]] == ["config", "data"]  # no keys Secret mounted


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v["gateway"].pop("keysSecret"), "set gateway.keysSecret"),
        (
            lambda v: v["gateway"]["config"]["tenants"][0].update(api_keys=["sk-by-hand"]),
            "gateway.config.tenants: planner: api_keys would be written into the ConfigMap",
        ),
    ],
    ids=["no-secret", "literal-keys-by-hand"],
)
def test_the_chart_refuses_tenants_without_their_secret(tmp_path, change, message):
    values = values_for(checkout(tmp_path))
    change(values)
    with pytest.raises(helm.HelmRenderError) as refused:
        render(values)
    assert message in str(refused.value)


def test_the_chart_names_every_variable_a_secret_must_hold(tmp_path):
    """Without key files the message lists the variables the Secret must hold."""
    values = values_for(checkout(tmp_path, TENANTS.replace("api_keys_file: keys/articles.txt", "api_keys_env: ART")))
    values["gateway"].pop("keysSecret")
    with pytest.raises(helm.HelmRenderError) as refused:
        render(values)
    assert (
        "gateway.keysSecret: the gateway config reads PLANNER_KEYS, ART, GATEWAY_SALT_SECRET, GATEWAY_REDIS_URL"
        in str(refused.value)
    )


EXAMPLE = ROOT / "configs/gateway.tenants.yaml"


def test_the_example_tenants_config_renders_both_ways_without_keys(tmp_path, capsys):
    """configs/gateway.tenants.yaml (the docs' example) is a deployable config: compose and Helm
    take it, passing its tenants' variables by name, and the gateway's own loader accepts it."""
    settings = load_settings(EXAMPLE)
    assert [t.api_keys_env for t in settings.tenants or ()] == ["PLANNER_KEYS", "ARTICLES_KEYS"]
    output = ROOT / "docker/compose.tenants.yaml"  # rendered, not written: the checkout's layout
    files = compose.render_files(settings.models, config=EXAMPLE, output=output)
    env = yaml.safe_load(files[output])["services"]["gateway"]["environment"]
    assert env == {"GATEWAY_ADMIN_KEYS": None, "PLANNER_KEYS": None, "ARTICLES_KEYS": None}
    capsys.readouterr()
    assert cli_main(["helm-values", "--config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert f"# The Secret {KEYS_SECRET} must hold: PLANNER_KEYS, ARTICLES_KEYS" in out
    (container,) = named(render(yaml.safe_load(out)), "Deployment", "llm-llm-serving-gateway")["spec"]["template"][
        "spec"
    ]["containers"]
    assert [e["name"] for e in container["env"]] == ["PLANNER_KEYS", "ARTICLES_KEYS", "GATEWAY_ADMIN_KEYS"]
