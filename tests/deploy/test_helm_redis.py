"""The chart's Redis for tenants' quotas (charts/llm-serving/templates/redis.yaml): off by default,
one pod and its Service with `redis.deploy` (the gateway pointed at it), or a URL of the operator's."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.test_helm import CHART, GPU_CONFIG, KUBERNETES_VERSIONS, render, values_for


def with_redis(deploy: bool, backend: str = "redis", **gateway: Any) -> dict[str, Any]:
    values = values_for(GPU_CONFIG)
    values["redis"] = {"deploy": deploy}
    values["gateway"]["config"]["quota_store"] = {"backend": backend}
    values["gateway"].update(gateway)
    return values


def gateway_env(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    label = "app.kubernetes.io/component"
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["labels"][label] == "gateway"]
    return deployment["spec"]["template"]["spec"]["containers"][0].get("env", [])


def quota_store_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "quota-store"]


def test_no_redis_unless_asked():
    objects = render(values_for(GPU_CONFIG))
    assert quota_store_objects(objects) == []
    assert not [e for e in gateway_env(objects) if e["name"] == "GATEWAY_REDIS_URL"]


def test_a_deployed_redis_is_one_pod_and_a_service_the_gateway_is_pointed_at():
    objects = render(with_redis(True))
    found = {(o["kind"], o["metadata"]["name"]) for o in quota_store_objects(objects)}
    assert found == {("Deployment", "llm-llm-serving-redis"), ("Service", "llm-llm-serving-redis")}
    assert {"name": "GATEWAY_REDIS_URL", "value": "redis://llm-llm-serving-redis:6379/0"} in gateway_env(objects)
    (pod,) = [o["spec"]["template"]["spec"] for o in quota_store_objects(objects) if o["kind"] == "Deployment"]
    args = pod["containers"][0]["args"]
    assert args[:4] == ["--save", "", "--appendonly", "no"] and "volatile-ttl" in args
    for version in (KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]):
        for obj in quota_store_objects(render(with_redis(True), kube_version=version)):
            kubernetes_validate.validate(obj, version, strict=True)
        report = helm.lint(CHART, with_redis(True), strict=True, kube_version=f"v{version}")
        assert report["errors"] == [], report


def test_the_operators_url_wins_and_a_redis_nobody_uses_is_refused():
    url = "redis://quota.example.svc:6379/2"
    objects = render(with_redis(False, redisUrl=url))
    assert quota_store_objects(objects) == []
    assert {"name": "GATEWAY_REDIS_URL", "value": url} in gateway_env(objects)
    with helm.Chart.load(CHART) as chart, pytest.raises(Exception, match="redis.deploy: the gateway would not use it"):
        chart.render(with_redis(True, backend="local"), name="llm")
