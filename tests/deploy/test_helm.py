"""The Helm chart, checked offline as Helm and the Kubernetes API would read it.

No cluster here. Helm itself (PyPI helm-python-sdk: Helm's Go SDK as a library) lints the chart,
validates values against values.schema.json and renders it, for a matrix of values rendered by
`python -m server helm-values` from made-up configs (one model, several profiles, tensor
parallel 2, autoscaling on, with and without the Prometheus Operator's API); every rendered
core object goes through `kubernetes-validate --strict` for each supported Kubernetes version.
Custom resources (ServiceMonitor, PodMonitor, PrometheusRule, ScaledObject) have no schema
there: they are checked for what the chart promises, and the alert rules with promtool. An engine
over several nodes is a LeaderWorkerSet: checked against charts/schemas/leaderworkerset.x-k8s.io_v1
.schema.json (written from the LWS API reference; no registry package ships the CRD), with each of
its pod templates wrapped in a core PodTemplate for `kubernetes-validate --strict`.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_python import _native

from server.cli import main as cli_main
from server.deploy import helm as values_renderer
from server.deploy.plan import plan_deployment
from server.engine.render import engine_argv
from server.gateway.settings import load_settings

from .conftest import DOCKER, ROOT

CHART = ROOT / "charts/llm-serving"
COMMITTED_VALUES = ROOT / "charts/values.gpu.yaml"
GPU_CONFIG = ROOT / "configs/gateway.gpu.yaml"
# The chart's kubeVersion is >=1.29; kubernetes-validate ships schemas up to 1.37.
KUBERNETES_VERSIONS = ["1.29.0", "1.31.0", "1.33.0", "1.35.0", "1.37.0"]
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject", "LeaderWorkerSet"}
MULTI_NODE_CONFIG = ROOT / "charts/examples/deepseek-v3-two-nodes.gateway.yaml"
MULTI_NODE_VALUES = ROOT / "charts/examples/values.deepseek-v3-two-nodes.yaml"
LWS_SCHEMA = json.loads((ROOT / "charts/schemas/leaderworkerset.x-k8s.io_v1.schema.json").read_text())


def render(
    values: dict[str, Any], *, api_versions: tuple[str, ...] = (), kube_version: str | None = None, name: str = "llm"
) -> list[dict[str, Any]]:
    """`helm template` of the chart: every object it renders.

    helm-python-sdk's `Chart.render` has no keyword for the cluster's API versions; its native
    call takes them (`--api-versions` of `helm template`), so this passes them itself.
    """
    options: dict[str, Any] = {"name": name, "namespace": "serving", "api_versions": list(api_versions)}
    if kube_version:
        options["kube_version"] = f"v{kube_version}"
    with helm.Chart.load(CHART) as chart:
        manifests = json.loads(
            _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(options))
        )
    return [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def values_for(config: Path) -> dict[str, Any]:
    settings = load_settings(config)
    text = values_renderer.render_file(settings.models, config=config, shutdown_grace=settings.limits.shutdown_grace)
    values: dict[str, Any] = yaml.safe_load(text)
    return values


GPU_PROFILE = """\
model: org/{name}
served_model_name: {name}
device: gpu
replicas: {replicas}
vllm:
  max-model-len: 4096
  tensor-parallel-size: {tp}
  pipeline-parallel-size: {pp}
"""


def write_config(tmp_path: Path, body: str, **profiles: str) -> Path:
    for name, text in profiles.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    config = tmp_path / "gateway.yaml"
    config.write_text(body)
    return config


def several_profiles(tmp_path: Path) -> dict[str, Any]:
    profiles = ROOT / "configs/profiles"
    config = write_config(
        tmp_path,
        (
            f"models:\n  - profile: {profiles / 'chat-fp8.yaml'}\n  - profile: {profiles / 'rag-prefix.yaml'}\n"
            f"  - profile: {profiles / 'long-context.yaml'}\n"
            "  - name: far\n    urls: [http://10.0.0.7:8000]\n    trimming: {mode: strict}\n"
            "  - name: elsewhere\n    dns: [engines.other.svc:8000]\n"
            "routing:\n  policy: round_robin\nlimits:\n  shutdown_grace: 12.5\n"
        ),
    )
    return values_for(config)


def tensor_parallel_2(tmp_path: Path) -> dict[str, Any]:
    config = write_config(
        tmp_path, "models:\n  - profile: big.yaml\n", big=GPU_PROFILE.format(name="big", replicas=2, tp=2, pp=1)
    )
    return values_for(config)


def tp2_pp2(tmp_path: Path) -> dict[str, Any]:
    config = write_config(
        tmp_path, "models:\n  - profile: huge.yaml\n", huge=GPU_PROFILE.format(name="huge", replicas=1, tp=2, pp=2)
    )
    return values_for(config)


def autoscaling_on(tmp_path: Path) -> dict[str, Any]:
    values = values_for(GPU_CONFIG)
    values["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    return values


def secrets_and_cache(tmp_path: Path) -> dict[str, Any]:
    values = values_for(GPU_CONFIG)
    values["huggingface"] = {"token": "hf_test"}
    values["gateway"]["apiKeys"] = "sk-a,sk-b"
    values["modelCache"] = {"type": "persistentVolumeClaim", "size": "200Gi", "storageClassName": "fast"}
    values["engineResources"] = {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}}
    return values


def cpu_tiny(tmp_path: Path) -> dict[str, Any]:
    return values_for(ROOT / "configs/gateway.yaml")


CASES = {
    "one-model": lambda tmp_path: values_for(GPU_CONFIG),
    "several-profiles": several_profiles,
    "tensor-parallel-2": tensor_parallel_2,
    "tp2-pp2": tp2_pp2,
    "autoscaling-on": autoscaling_on,
    "secrets-and-pvc": secrets_and_cache,
    "cpu-tiny-model": cpu_tiny,
    "deepseek-v3-one-host-dp8": lambda tmp_path: values_for(
        write_config(tmp_path, f"models:\n  - profile: {ROOT / 'configs/profiles/deepseek-v3.yaml'}\n")
    ),
    "deepseek-v3-two-nodes": lambda tmp_path: values_for(MULTI_NODE_CONFIG),
}
MONITORING = {"monitoring-crds": (PROMETHEUS_OPERATOR,), "no-monitoring-crds": ()}


@pytest.fixture(params=CASES, ids=str)
def case(request, tmp_path) -> tuple[str, dict[str, Any]]:
    return request.param, CASES[request.param](tmp_path)


@pytest.fixture(params=MONITORING, ids=str)
def api_versions(request) -> tuple[str, ...]:
    return MONITORING[request.param]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


# -- the committed values and the CLI ----------------------------------------------------------


def test_committed_values_equal_a_fresh_rendering(capsys):
    code = cli_main(["helm-values", "--config", str(GPU_CONFIG), "--output", str(COMMITTED_VALUES), "--check"])
    assert code == 0, capsys.readouterr().err


def test_check_reports_drift_and_exit_1(tmp_path, capsys):
    copy_ = tmp_path / "values.yaml"
    copy_.write_text(COMMITTED_VALUES.read_text().replace("'8192'", "'4096'"))
    assert cli_main(["helm-values", "--config", str(GPU_CONFIG), "--output", str(copy_), "--check"]) == 1
    err = capsys.readouterr().err
    assert "+  - '8192'" in err and "make helm-values" in err
    assert cli_main(["helm-values", "--config", str(GPU_CONFIG), "--output", str(copy_)]) == 0
    assert copy_.read_text() == COMMITTED_VALUES.read_text()


def test_values_come_from_the_plan_and_the_engine_renderer():
    values = yaml.safe_load(COMMITTED_VALUES.read_text())
    settings = load_settings(GPU_CONFIG)
    plan = plan_deployment(settings.models, config=GPU_CONFIG, placement="services")
    assert [e["model"] for e in values["engines"]] == [m.name for m in plan.models if m.engines]
    for engine, model in zip(values["engines"], [m for m in plan.models if m.engines]):
        profile = model.profile
        assert profile is not None
        assert engine["args"] == engine_argv(profile, host="0.0.0.0", port=8000, launcher="image")
        assert engine["replicas"] == profile.replicas == len(model.engines)
        assert engine["gpus"] == profile.tensor_parallel_size * profile.pipeline_parallel_size
        assert engine["nodes"] == 1
    assert values["gateway"]["config"] == {"timeouts": settings.timeouts.model_dump()}


def test_a_local_model_folder_is_refused(tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    config = write_config(
        tmp_path, "models:\n  - profile: p.yaml\n", p="model: ./weights\nserved_model_name: mine\ndevice: gpu\n"
    )
    assert cli_main(["helm-values", "--config", str(config)]) == 2
    assert "hub id" in capsys.readouterr().err


def test_two_profile_entries_of_one_model_are_refused(tmp_path, capsys):
    profile = GPU_PROFILE.format(name="m", replicas=1, tp=1, pp=1)
    config = write_config(tmp_path, "models:\n  - profile: a.yaml\n  - profile: b.yaml\n", a=profile, b=profile)
    assert cli_main(["helm-values", "--config", str(config)]) == 2
    assert "replicas" in capsys.readouterr().err


# -- lint and render, over the matrix ----------------------------------------------------------


def test_the_chart_lints_strictly(case):
    _, values = case
    for version in (KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_core_object_validates_strictly_on_every_supported_kubernetes(case, api_versions):
    _, values = case
    checked = 0
    for version in KUBERNETES_VERSIONS:
        for obj in render(values, api_versions=api_versions, kube_version=version):
            if obj["kind"] in CUSTOM_KINDS:
                continue
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked >= len(KUBERNETES_VERSIONS) * 5  # gateway ConfigMap, Deployment, Service, PDB + engines


def test_the_validator_can_fail():
    (deployment,) = [
        o
        for o in render(values_for(GPU_CONFIG))
        if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    ]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_engines_get_their_profile_gpus_args_probes_and_volumes(case, api_versions):
    _, values = case
    objects = render(values, api_versions=api_versions)
    for engine in values["engines"]:
        if engine["nodes"] > 1:
            continue  # a LeaderWorkerSet: test_an_engine_over_two_nodes_is_one_leader_worker_group
        name = f"llm-llm-serving-{engine['name']}"
        deployment = named(objects, "Deployment", name)
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        drain = max(1, pod["terminationGracePeriodSeconds"] - 10)  # vLLM's --shutdown-timeout, inside the grace
        assert container["args"] == engine["args"] + ["--shutdown-timeout", str(drain)]
        limits = container.get("resources", {}).get("limits", {})
        if engine["device"] == "gpu":
            tp = int(_flag(engine["args"], "--tensor-parallel-size", "1"))
            pp = int(_flag(engine["args"], "--pipeline-parallel-size", "1"))
            dp = int(_flag(engine["args"], "--data-parallel-size", "1"))
            assert limits["nvidia.com/gpu"] == tp * pp * dp == engine["gpus"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        else:
            assert "nvidia.com/gpu" not in limits
        if values.get("autoscaling", {}).get("enabled"):
            assert "replicas" not in deployment["spec"]  # KEDA owns it
        else:
            assert deployment["spec"]["replicas"] == engine["replicas"]
        startup = container["startupProbe"]
        assert startup["httpGet"]["path"] == "/health"
        assert startup["periodSeconds"] * startup["failureThreshold"] >= engine["startupSeconds"] >= 600
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["shm"] == "/dev/shm" and mounts["model-cache"] == engine["env"]["HF_HOME"]
        env = {e["name"]: e for e in container["env"]}
        assert {k: env[k]["value"] for k in engine["env"]} == engine["env"]
        if values.get("huggingface", {}).get("token"):
            ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
            secret = named(objects, "Secret", ref["name"])
            assert ref["key"] in secret["stringData"]
            claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
            assert named(objects, "PersistentVolumeClaim", claim)["spec"]["storageClassName"] == "fast"
        else:
            assert "HF_TOKEN" not in env and "emptyDir" in volumes["model-cache"]
        service = named(objects, "Service", name)
        assert service["spec"]["clusterIP"] == "None"  # headless: one address per ready pod
        assert service["spec"]["selector"].items() <= pod_labels(deployment).items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def _flag(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def test_the_gateway_config_map_is_a_config_the_gateway_loads(case, tmp_path):
    _, values = case
    objects = render(values)
    (config_map,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"] == "llm-llm-serving-gateway"]
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    settings = load_settings(path)  # what `serve --config` reads in the gateway pod
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    services = {o["metadata"]["name"] for o in by_kind(objects, "Service")}
    expected: dict[str, list[str]] = {}
    for model in values["gateway"]["models"]:
        if "engine" in model:
            (engine,) = [e for e in values["engines"] if e["name"] == model["engine"]]
            service = f"llm-llm-serving-{model['engine']}" + ("-leader" if engine["nodes"] > 1 else "")
            assert service in services
            expected.setdefault(model["name"], []).append(f"dns {service}:8000")  # its headless Service
        elif "dns" in model:  # names of its own, as the config wrote them
            expected.setdefault(model["name"], []).extend(f"dns {name}" for name in model["dns"])
        else:
            expected.setdefault(model["name"], []).extend(model["urls"])
    served = plan_deployment(settings.models, config=path).served_models()
    assert {m.name: m.urls + [f"dns {name}" for name in m.dns] for m in served} == expected
    assert not plan_deployment(settings.models, config=path).engines  # the gateway pod starts none
    for key, value in values["gateway"]["config"].items():
        assert getattr(settings, key).model_dump() == {**getattr(settings, key).model_dump(), **value}


def test_the_gateway_drains_within_its_grace_period(case):
    _, values = case
    objects = render(values)
    gateway = named(objects, "Deployment", "llm-llm-serving-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = values["gateway"]["shutdownGraceSeconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["args"][:3] == ["serve", "--config", "/etc/gateway/gateway.yaml"]
    pdb = named(objects, "PodDisruptionBudget", "llm-llm-serving-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(gateway).items()
    service = named(objects, "Service", "llm-llm-serving-gateway")
    assert service["spec"]["selector"].items() <= pod_labels(gateway).items()
    keys = values["gateway"].get("apiKeys")
    env = {e["name"]: e for e in container.get("env", [])}
    if keys:
        ref = env["GATEWAY_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert named(objects, "Secret", ref["name"])["stringData"][ref["key"]] == keys
    else:
        assert "GATEWAY_API_KEYS" not in env


@pytest.mark.parametrize(("workers", "argv"), [(None, "2"), (4, "4"), ("auto", "auto")])
def test_the_gateway_runs_its_workers_and_the_cli_takes_the_value(tmp_path, workers, argv):
    values = several_profiles(tmp_path)
    if workers is not None:
        values["gateway"]["workers"] = workers
    (container,) = named(render(values), "Deployment", "llm-llm-serving-gateway")["spec"]["template"]["spec"][
        "containers"
    ]
    assert _flag(container["args"], "--workers", "") == argv
    from server.cli import build_parser
    from server.gateway.settings import usable_cores, worker_count

    expected = int(argv) if argv.isdigit() else usable_cores()
    assert worker_count(build_parser().parse_args(container["args"]).workers) == expected


def test_shutdown_grace_comes_from_the_config(tmp_path):
    values = several_profiles(tmp_path)
    assert values["gateway"]["shutdownGraceSeconds"] == 13  # limits.shutdown_grace 12.5, rounded up
    assert values["gateway"]["config"]["limits"] == {"shutdown_grace": 12.5}


# -- monitoring and autoscaling ------------------------------------------------------------------


def test_prometheus_operator_objects_only_where_its_api_exists(case, api_versions):
    _, values = case
    kinds = {o["kind"] for o in render(values, api_versions=api_versions)}
    expected = {"ServiceMonitor", "PodMonitor", "PrometheusRule"} if api_versions else set()
    assert kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"} == expected


def test_monitors_select_what_the_chart_runs_and_the_rules_are_the_alerts_file():
    values = values_for(GPU_CONFIG)
    values["monitoring"] = {"labels": {"release": "kube-prometheus-stack"}}
    objects = render(values, api_versions=(PROMETHEUS_OPERATOR,))
    gateway_service = named(objects, "Service", "llm-llm-serving-gateway")
    (service_monitor,) = by_kind(objects, "ServiceMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= gateway_service["metadata"]["labels"].items()
    # The alert rules select job="gateway": the job label comes from this Service label.
    assert gateway_service["metadata"]["labels"][service_monitor["spec"]["jobLabel"]] == "gateway"
    (pod_monitor,) = by_kind(objects, "PodMonitor")
    for engine in by_kind(objects, "Deployment"):
        if engine["metadata"]["labels"]["app.kubernetes.io/component"] == "engine":
            assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels(engine).items()
    (rule,) = by_kind(objects, "PrometheusRule")
    alerts = yaml.safe_load((DOCKER / "prometheus/alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


@pytest.mark.prometheus
def test_promtool_accepts_the_rendered_alert_rules(tmp_path):
    (rule,) = by_kind(render(values_for(GPU_CONFIG), api_versions=(PROMETHEUS_OPERATOR,)), "PrometheusRule")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: `make prometheus` installs the Debian package")
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_are_config_maps_for_the_grafana_sidecar():
    objects = render(values_for(GPU_CONFIG))
    dashboards = [o for o in by_kind(objects, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    shipped = sorted(p.name for p in (DOCKER / "grafana/dashboards").glob("*.json"))
    assert sorted(name for d in dashboards for name in d["data"]) == shipped and shipped
    for dashboard in dashboards:
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        for name, text in dashboard["data"].items():
            assert json.loads(text) == json.loads((DOCKER / "grafana/dashboards" / name).read_text())


def test_autoscaling_is_off_by_default_and_scales_each_engine_on_its_queue(tmp_path):
    assert not by_kind(render(values_for(GPU_CONFIG)), "ScaledObject")
    values = several_profiles(tmp_path)
    values["autoscaling"] = {"enabled": True, "maxReplicas": 6, "waitingRequestsPerReplica": 4}
    objects = render(values)
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in by_kind(objects, "ScaledObject")}
    engines = {f"llm-llm-serving-{e['name']}": e for e in values["engines"]}
    assert scaled.keys() == engines.keys()
    for name, obj in scaled.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        assert obj["spec"]["maxReplicaCount"] == 6
        queue, kv = obj["spec"]["triggers"]
        model = engines[name]["model"]
        assert queue["metadata"]["query"] == f'sum(vllm:num_requests_waiting{{model_name="{model}"}})'
        assert queue["metadata"]["threshold"] == "4" and queue["metricType"] == "AverageValue"
        assert kv["metadata"]["query"] == f'avg(vllm:kv_cache_usage_perc{{model_name="{model}"}})'
        assert named(objects, "Deployment", name)  # the target exists


# -- values.schema.json: one refused value per rule ----------------------------------------------


Path_ = tuple[str | int, ...]


def schema_violations(schema: Any, valid: Any, path: Path_ = ()) -> Iterator[tuple[str, Path_, Any, str]]:
    """(rule, where to set, a value that breaks it, the key Helm must name) for every constraint.

    Walks the schema alongside a valid document, so each case changes one thing in a document
    that is otherwise valid. A key dropped from an object the chart has defaults for is set to
    null (Helm's way to delete a default); in a list item it is left out.
    """
    here = "/" + "/".join(map(str, path)) if path else ""
    if "type" in schema and path:  # values are a mapping before any schema sees them
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        wrong = next(
            v
            for t, v in [
                ("object", {"x": 1}),
                ("string", "x"),
                ("integer", 1),
                ("boolean", True),
                ("array", ["x"]),
                ("null", None),
            ]
            if t not in types and not (t == "integer" and "number" in types)
        )
        yield "type", path, wrong, here
    if "enum" in schema:
        yield "enum", path, "not-one-of-them", here
    if "pattern" in schema:
        yield "pattern", path, "Not Valid!", here
    if "minLength" in schema:
        yield "minLength", path, "", here
    if "maxLength" in schema:
        yield "maxLength", path, "a" * (schema["maxLength"] + 1), here
    if "minimum" in schema:
        yield "minimum", path, schema["minimum"] - 1, here
    if "maximum" in schema:
        yield "maximum", path, schema["maximum"] + 1, here
    if "exclusiveMinimum" in schema:
        yield "exclusiveMinimum", path, schema["exclusiveMinimum"], here
    if "minItems" in schema:
        yield "minItems", path, [], here
    if "oneOf" in schema:
        yield "oneOf", path, {k: v for k, v in valid.items() if k not in ("engine", "urls")}, here
    if schema.get("additionalProperties") is False:
        yield "additionalProperties", path, {**valid, "bogus": 1}, here
    in_list = any(isinstance(part, int) for part in path)
    for key in schema.get("required", []):
        if key in valid:
            dropped = {k: v for k, v in valid.items() if k != key} if in_list else {**valid, key: None}
            yield "required", path, dropped, here
    for key, sub in schema.get("properties", {}).items():
        if sub is False:
            yield "false", path, {**valid, key: "anything"}, f"{here}/{key}"
        elif isinstance(valid, dict) and key in valid:
            yield from schema_violations(sub, valid[key], (*path, key))
    if isinstance(schema.get("items"), dict) and isinstance(valid, list):
        seen: set[tuple[str, str, int]] = set()  # each rule once, from the first item that has its subject
        for index, item in enumerate(valid):
            occurrences: dict[tuple[str, str], int] = {}
            for rule, where, bad, pointer in schema_violations(schema["items"], item, (*path, index)):
                general = (rule, pointer.replace(f"{here}/{index}", f"{here}/*", 1))
                occurrences[general] = occurrences.get(general, 0) + 1
                if (*general, occurrences[general]) not in seen:
                    seen.add((*general, occurrences[general]))
                    yield rule, where, bad, pointer


def full_valid_values() -> dict[str, Any]:
    """Every key of the schema set: the several-profiles render plus the chart's defaults."""
    with helm.Chart.load(CHART) as chart:
        defaults: dict[str, Any] = chart.values
    values = copy.deepcopy(defaults)
    rendered = yaml.safe_load((ROOT / "charts/values.gpu.yaml").read_text())
    values["engines"] = rendered["engines"]
    values["gateway"].update(rendered["gateway"])
    values["gateway"]["models"].append(
        {"name": "far", "urls": ["http://10.0.0.7:8000"], "trimming": {"mode": "off", "history_budget_tokens": 100}}
    )
    values["gateway"]["models"].append(
        {"name": "elsewhere", "dns": ["engines.other.svc:8000"], "trimming": {"mode": "off"}}
    )
    values["engineResources"] = {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}}
    values["nodeSelector"] = {"gpu": "a100"}
    values["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    values["monitoring"]["labels"] = {"release": "prom"}
    values["engines"] += yaml.safe_load(MULTI_NODE_VALUES.read_text())["engines"]  # subjects of the multi-node keys
    return values


def set_at(document: Any, path: Path_, value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(document)
    target = out
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return out


SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VIOLATIONS = list(schema_violations(SCHEMA, full_valid_values()))


def test_every_schema_rule_has_a_negative_case():
    rules = sum(1 for _ in _walk_rules(SCHEMA))
    assert len(VIOLATIONS) == rules, "a schema rule without a case (or a subject full_valid_values lacks)"
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(full_valid_values())  # the document the cases start from is valid


def _walk_rules(schema: Any, root: bool = True) -> Iterator[str]:
    """Every constraint keyword in the schema (`required` counted by its keys; not the root's type)."""
    if schema is False:
        yield "false"
        return
    if "type" in schema and not root:
        yield "type"
    for key in (
        "enum",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "minItems",
        "oneOf",
    ):
        if key in schema:
            yield key
    if schema.get("additionalProperties") is False:
        yield "additionalProperties"
    yield from ("required" for _ in schema.get("required", []))
    for sub in schema.get("properties", {}).values():
        yield from _walk_rules(sub, root=False)
    if isinstance(schema.get("items"), dict):
        yield from _walk_rules(schema["items"], root=False)


@pytest.mark.parametrize(
    ("rule", "path", "bad", "pointer"),
    VIOLATIONS,
    ids=[f"{rule}:{pointer or '/'}" for rule, _, _, pointer in VIOLATIONS],
)
def test_a_value_that_breaks_a_schema_rule_is_refused_with_its_key_named(rule, path, bad, pointer):
    values = set_at(full_valid_values(), path, bad)
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name="llm")
    assert f"at '{pointer}'" in str(refused.value), str(refused.value)


# -- an engine over several nodes: LeaderWorkerSet ------------------------------------------------


def test_the_committed_multi_node_example_equals_a_fresh_rendering(tmp_path, capsys):
    args = ["helm-values", "--config", str(MULTI_NODE_CONFIG), "--output"]
    assert cli_main([*args, str(MULTI_NODE_VALUES), "--check"]) == 0, capsys.readouterr().err
    drifted = tmp_path / "values.yaml"
    drifted.write_text(MULTI_NODE_VALUES.read_text().replace("ranksPerNode: 8", "ranksPerNode: 4"))
    assert cli_main([*args, str(drifted), "--check"]) == 1
    assert "+  ranksPerNode: 8" in capsys.readouterr().err


def lws_problems(obj: dict[str, Any], version: str) -> list[str]:
    """What the LeaderWorkerSet schema and Kubernetes' PodTemplateSpec schema say against `obj`."""
    import jsonschema

    problems = [error.message for error in jsonschema.Draft7Validator(LWS_SCHEMA).iter_errors(obj)]
    group = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    for key in ("leaderTemplate", "workerTemplate"):
        if key in group:
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group[key]}
            try:
                kubernetes_validate.validate(wrapped, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{key}: {exc}")
    return problems


def test_leader_worker_sets_validate_against_their_schema_and_kubernetes(api_versions):
    values = values_for(MULTI_NODE_CONFIG)
    for version in KUBERNETES_VERSIONS:
        (lws,) = by_kind(render(values, api_versions=api_versions, kube_version=version), "LeaderWorkerSet")
        assert lws_problems(lws, version) == []


@pytest.mark.parametrize(
    ("where", "bad", "expected"),
    [
        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always", "is not one of"),
        (("spec", "leaderWorkerTemplate", "size"), 0, "less than the minimum"),
        (("spec", "leaderWorkerTemplate", "sizes"), 2, "Additional properties"),
        (("spec", "startupPolicy"), "WorkersFirst", "is not one of"),
        (("spec", "rolloutStrategy", "rollingUpdateConfiguration", "maxSurge"), "one", "does not match"),
        (
            ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "imagePullPolicies"),
            "x",
            "workerTemplate",
        ),
        (
            (
                "spec",
                "leaderWorkerTemplate",
                "leaderTemplate",
                "spec",
                "containers",
                0,
                "readinessProbe",
                "httpGet",
                "port",
            ),
            [1],
            "leaderTemplate",
        ),
    ],
)
def test_the_leader_worker_set_checks_can_fail(where, bad, expected):
    (lws,) = by_kind(render(values_for(MULTI_NODE_CONFIG)), "LeaderWorkerSet")
    broken = set_at(lws, where, bad)
    problems = lws_problems(broken, KUBERNETES_VERSIONS[-1])
    assert any(expected in problem for problem in problems), problems


def test_an_engine_over_two_nodes_is_one_leader_worker_group():
    values = values_for(MULTI_NODE_CONFIG)
    (engine,) = values["engines"]
    objects = render(values, api_versions=(PROMETHEUS_OPERATOR,))
    assert not [
        o for o in by_kind(objects, "Deployment") if o["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ]
    lws = named(objects, "LeaderWorkerSet", "llm-llm-serving-deepseek-v3")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == engine["nodes"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost node restarts the whole engine
    assert lws["spec"]["replicas"] == 1
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    # The leader: the API server and ranks 0-7, pointed at itself; drains as a single engine does.
    assert _flag(leader["args"], "--data-parallel-address", "") == "$(LWS_LEADER_ADDRESS)"
    assert _flag(leader["args"], "--data-parallel-size", "") == "16"
    assert "--headless" not in leader["args"] and "--shutdown-timeout" in leader["args"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"  # vLLM answers once every node's engines started
    assert leader["startupProbe"]["httpGet"]["path"] == "/health"
    # A worker: headless, its ranks after the leader's, ready when the leader is.
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    assert "--data-parallel-start-rank $((LWS_WORKER_INDEX * 8))" in worker["command"][2]
    assert worker["command"][2].startswith('exec vllm serve "$@"')
    assert worker["args"] == engine["workerArgs"] and "--headless" in worker["args"]
    assert _flag(worker["args"], "--data-parallel-address", "") == "$(LWS_LEADER_ADDRESS)"
    assert "ports" not in worker and "startupProbe" not in worker
    probe = " ".join(worker["readinessProbe"]["exec"]["command"])
    assert 'os.environ["LWS_LEADER_ADDRESS"]' in probe and ":8000/health" in probe
    # One Service for the group: its leaders only; the gateway resolves it.
    service = named(objects, "Service", "llm-llm-serving-deepseek-v3-leader")
    assert service["spec"]["clusterIP"] == "None"
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= leader_labels.items()
    assert not service["spec"]["selector"].items() <= group["workerTemplate"]["metadata"]["labels"].items()
    config = yaml.safe_load(named(objects, "ConfigMap", "llm-llm-serving-gateway")["data"]["gateway.yaml"])
    assert config["models"][0]["dns"] == ["llm-llm-serving-deepseek-v3-leader:8000"]
    # The engines' PodMonitor scrapes the leader (the workers have no port to scrape).
    (pod_monitor,) = by_kind(objects, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= leader_labels.items()


def test_autoscaling_targets_the_leader_worker_set():
    values = values_for(MULTI_NODE_CONFIG)
    values["autoscaling"] = {"enabled": True}
    objects = render(values)
    (scaled,) = by_kind(objects, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "llm-llm-serving-deepseek-v3",
    }
    assert "replicas" not in named(objects, "LeaderWorkerSet", "llm-llm-serving-deepseek-v3")["spec"]


def test_one_host_data_parallel_is_one_pod_with_every_gpu(tmp_path):
    config = write_config(tmp_path, f"models:\n  - profile: {ROOT / 'configs/profiles/deepseek-v3.yaml'}\n")
    (engine,) = values_for(config)["engines"]
    assert (engine["nodes"], engine["gpus"]) == (1, 8)  # DP=8 x TP=1 on one host: not 1 GPU
    assert "workerArgs" not in engine and "--data-parallel-address" not in engine["args"]


def test_multi_node_engines_that_cannot_be_rendered_are_refused(tmp_path, capsys):
    profile = (ROOT / "configs/profiles/deepseek-v3-two-nodes.yaml").read_text()
    config = write_config(tmp_path, "models:\n  - profile: p.yaml\n", p=profile + "kv_events: true\n")
    assert cli_main(["helm-values", "--config", str(config)]) == 2
    assert "KV events of an engine over several nodes" in capsys.readouterr().err
    config = write_config(
        tmp_path,
        "models:\n  - profile: q.yaml\n",
        q=profile.replace("data-parallel-size-local: 8", "data-parallel-size-local: 3"),
    )
    with pytest.raises(Exception, match="does not divide data-parallel-size 16"):
        values_for(config)
