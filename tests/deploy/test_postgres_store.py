"""A PostgreSQL response store in the rendered deployments (responses_store.backend: postgres): compose
adds one PostgreSQL service (its password from the host, the gateway's URL defaulting to it), the Helm
chart deploys one (postgres.deploy: a StatefulSet on a volume claim, its password from a Secret) or
takes the operator's URL from gateway.keysSecret. No password is ever in a rendered file."""

from __future__ import annotations

import shutil
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from server.deploy.gateway_service import POSTGRES_IMAGE, POSTGRES_URL
from server.gateway.settings import load_settings
from tests.deploy.test_helm import CHART, GPU_CONFIG, KUBERNETES_VERSIONS, render, values_for
from tests.deploy.test_helm_redis import gateway_env
from tests.deploy.test_tenants_render import checkout, rendered_compose

from .test_dclint import DCLINT, dclint

POSTGRES = "responses_store:\n  backend: postgres\n"


def test_compose_runs_a_postgres_the_gateway_waits_for_and_finds_by_default(tmp_path):
    config = checkout(tmp_path, tenants=POSTGRES)
    files = rendered_compose(config)
    rendered = yaml.safe_load(files[tmp_path / "docker/compose.yaml"])
    services = rendered["services"]
    postgres, gateway = services["postgres"], services["gateway"]
    assert postgres["image"] == POSTGRES_IMAGE
    assert postgres["environment"]["POSTGRES_PASSWORD"].startswith("${GATEWAY_POSTGRES_PASSWORD:?")
    assert postgres["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert "postgres-data:/var/lib/postgresql/data" in postgres["volumes"] and "postgres-data" in rendered["volumes"]
    # The operator's URL wins; else this file's PostgreSQL, the password from the host's variable.
    assert gateway["environment"]["GATEWAY_DATABASE_URL"] == f"${{GATEWAY_DATABASE_URL:-{POSTGRES_URL}}}"
    assert "${GATEWAY_POSTGRES_PASSWORD}" in POSTGRES_URL
    assert gateway["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert load_settings(tmp_path / "docker/gateway.yaml").responses_store.backend == "postgres"


def test_compose_adds_no_postgres_for_the_default_sqlite_store(tmp_path):
    services = yaml.safe_load(rendered_compose(checkout(tmp_path, tenants=""))[tmp_path / "docker/compose.yaml"])[
        "services"
    ]
    assert "postgres" not in services and "GATEWAY_DATABASE_URL" not in services["gateway"]["environment"]


@pytest.mark.skipif(shutil.which("node") is None or not DCLINT.exists(), reason="dclint needs node and its install")
def test_the_postgres_compose_file_passes_dclint(tmp_path):
    rendered_compose(checkout(tmp_path, tenants=POSTGRES))
    (report,) = dclint(tmp_path / "docker/compose.yaml")
    problems = [f"{m['line']}: {m['type']} {m['rule']}: {m['message']}" for m in report["messages"]]
    assert not problems, problems


def with_postgres(deploy: bool, backend: str = "postgres", **postgres: Any) -> dict[str, Any]:
    values = values_for(GPU_CONFIG)
    values["postgres"] = {"deploy": deploy, **postgres}
    values["gateway"]["config"]["responses_store"] = {"backend": backend}
    return values


def store_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "response-store"]


def test_the_chart_deploys_a_postgres_and_points_the_gateway_at_it():
    values = with_postgres(True, passwordSecret="llm-postgres")
    objects = render(values)
    found = {(o["kind"], o["metadata"]["name"]) for o in store_objects(objects)}
    assert found == {("StatefulSet", "llm-llm-serving-postgres"), ("Service", "llm-llm-serving-postgres")}
    env = gateway_env(objects)
    names = [e["name"] for e in env]
    # The password first, from the Secret; the URL after it, built from it by Kubernetes ($(VAR)).
    assert names.index("GATEWAY_POSTGRES_PASSWORD") < names.index("GATEWAY_DATABASE_URL")
    password = env[names.index("GATEWAY_POSTGRES_PASSWORD")]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "llm-postgres", "key": "POSTGRES_PASSWORD"}
    url = env[names.index("GATEWAY_DATABASE_URL")]["value"]
    assert url == "postgresql://gateway:$(GATEWAY_POSTGRES_PASSWORD)@llm-llm-serving-postgres:5432/gateway"
    (statefulset,) = [o for o in store_objects(objects) if o["kind"] == "StatefulSet"]
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    for version in (KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]):
        for obj in store_objects(render(values, kube_version=version)):
            kubernetes_validate.validate(obj, version, strict=True)
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert report["errors"] == [], report


def test_without_deploy_the_url_comes_from_the_keys_secret():
    values = with_postgres(False)
    with helm.Chart.load(CHART) as chart, pytest.raises(Exception, match="GATEWAY_DATABASE_URL"):
        chart.render(values, name="llm")  # a URL holds a password: only from a Secret, and none is named
    values["gateway"]["keysSecret"] = "llm-keys"
    objects = render(values)
    assert store_objects(objects) == []
    (url,) = [e for e in gateway_env(objects) if e["name"] == "GATEWAY_DATABASE_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "llm-keys", "key": "GATEWAY_DATABASE_URL"}


def test_a_postgres_nobody_uses_or_without_a_password_is_refused():
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(Exception, match="postgres.deploy: the gateway would not use it"):
            chart.render(with_postgres(True, backend="sqlite", passwordSecret="x"), name="llm")
        with pytest.raises(Exception, match="postgres.passwordSecret"):
            chart.render(with_postgres(True), name="llm")
