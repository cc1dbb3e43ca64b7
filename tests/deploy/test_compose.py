"""The compose files are the profiles' truth: rendered by the one engine renderer, never drifting."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from server.cli import main as cli_main
from server.config import SettingsError, profile_path
from server.deploy import compose, containers
from server.deploy.plan import plan_deployment
from server.engine.profiles import load_profile
from server.engine.render import engine_argv
from server.gateway.settings import load_settings

from .conftest import DOCKER, ROOT, VARIANTS


def render(config: Path, output: Path) -> dict[Path, str]:
    return compose.render_files(load_settings(config).models, config=config, output=output)


def tiny_model_built_in_cpu_image() -> str:
    """Where docker/Dockerfile.vllm-cpu builds the tiny model (the CPU engines' model argument)."""
    text = (DOCKER / "Dockerfile.vllm-cpu").read_text()
    found = re.findall(r"python -m server tiny-model (\S+)", text)
    assert len(found) == 1, "Dockerfile.vllm-cpu builds the tiny model once"
    return found[0]


def expected_model_argument(profile) -> str | None:
    if profile.model_path is None:
        return None  # a hub id: engine_argv passes it as it is
    assert profile.build_tiny_model, f"{profile.name}: only the tiny model is a local path here"
    return tiny_model_built_in_cpu_image()


def test_committed_files_equal_a_fresh_rendering(variant, capsys):
    code = cli_main(["compose", "--config", str(variant.config), "--output", str(variant.compose), "--check"])
    assert code == 0, capsys.readouterr().err


def expected_engine_services(config: Path) -> dict[str, tuple[object, int, int | None]]:
    """Service name -> (profile, port, replicas of a scaled service or None) that the config asks for.

    An entry with a one-label `dns` name is one service of that name, scaled to the profile's
    replicas; any other profile entry is one service per replica, `engine-<model>-<i>`, on 8000.
    """
    out: dict[str, tuple[object, int, int | None]] = {}
    for entry in load_settings(config).models:
        profile = load_profile(profile_path(entry, config))
        model = entry.name or profile.served_model_name
        scaled = [target.rsplit(":", 1) for target in entry.dns if "." not in target.rsplit(":", 1)[0]]
        for name, port in scaled:
            out[name] = (profile, int(port), profile.replicas)
        if not entry.dns:
            for replica in range(profile.replicas):
                out[f"engine-{re.sub(r'[^a-z0-9]+', '-', model.lower()).strip('-')}-{replica}"] = (profile, 8000, None)
    return out


def test_engine_commands_equal_the_renderer_for_every_profile_and_replica(variant):
    services = variant.compose_data()["services"]
    expected = expected_engine_services(variant.config)
    assert expected
    for name, (profile, port, replicas) in expected.items():
        argv = engine_argv(profile, host="0.0.0.0", port=port, launcher="image", model=expected_model_argument(profile))
        service = services[name]
        # vLLM's drain on SIGTERM, after the renderer's flags: in-flight requests finish first.
        assert service["command"] == [*argv, "--shutdown-timeout", str(containers.ENGINE_DRAIN_SECONDS)]
        for key, value in profile.env.items():
            assert service["environment"][key] == value
        image = containers.VLLM_GPU_IMAGE if profile.device == "gpu" else containers.VLLM_CPU_IMAGE
        assert service["image"] == image
        assert service.get("deploy", {}).get("replicas") == replicas
    assert {name for name in services if name.startswith("engine-")} == set(expected)


def test_engines_drain_within_the_grace_docker_gives_them(variant):
    """`docker compose down`: vLLM's --shutdown-timeout lets requests finish, inside stop_grace_period.

    Docker sends SIGTERM, waits stop_grace_period (10 s when absent), then SIGKILL; the gateway,
    stopped first (it depends on the engines), gets its own drain (limits.shutdown_grace).
    """
    services = variant.compose_data()["services"]
    engines = {name: s for name, s in services.items() if name.startswith("engine-")}
    assert engines
    for name, service in engines.items():
        drain = int(_flag(service["command"], "--shutdown-timeout", "0"))
        assert drain > 0, name
        assert seconds(service["stop_grace_period"]) >= drain + 5, name
    grace = load_settings(variant.config).limits.shutdown_grace
    assert seconds(services["gateway"]["stop_grace_period"]) > grace
    assert set(services["gateway"]["depends_on"]) == set(engines)


def seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return int(match.group(1))


def test_a_profile_that_sets_its_own_shutdown_timeout_keeps_it(tmp_path):
    config = write_config(
        tmp_path,
        "  - profile: profiles/a.yaml\n",
        a=GPU_PROFILE.format(n=1, name="a", replicas=1, tp=1) + "  shutdown-timeout: 120\n",
    )
    service = yaml.safe_load(render(config, tmp_path / "docker/compose.yaml")[tmp_path / "docker/compose.yaml"])[
        "services"
    ]["engine-a-0"]
    assert service["command"].count("--shutdown-timeout") == 1
    assert _flag(service["command"], "--shutdown-timeout", "") == "120"
    assert service["stop_grace_period"] == "130s"


def test_the_cpu_image_defaults_are_the_tiny_cpu_profile():
    """`docker run llm-serving/vllm-cpu` without arguments runs what the profile says."""
    text = (DOCKER / "Dockerfile.vllm-cpu").read_text()
    profile = load_profile(ROOT / "configs/profiles/tiny-cpu.yaml")
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))
    assert cmd == engine_argv(
        profile, host="0.0.0.0", port=8000, launcher="image", model=tiny_model_built_in_cpu_image()
    )
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))
    # With the model flag last, the arguments after the entrypoint are launcher="image"'s.
    assert entrypoint == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    env = dict(re.findall(r"(VLLM_[A-Z_]+)=(\S+)", text))
    assert env == profile.env


def test_gpu_engines_reserve_their_own_gpus(variant):
    services = variant.compose_data()["services"]
    taken: list[str] = []
    for name, service in services.items():
        if service.get("image") != containers.VLLM_GPU_IMAGE or not name.startswith("engine-"):
            assert "resources" not in service.get("deploy", {}), name  # downloads run in the vLLM image, without GPUs
            continue
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert [d["driver"] for d in devices] == ["nvidia"]
        assert devices[0]["capabilities"] == ["gpu"]
        tp = int(_flag(service["command"], "--tensor-parallel-size", "1"))
        pp = int(_flag(service["command"], "--pipeline-parallel-size", "1"))
        assert len(devices[0]["device_ids"]) == tp * pp, name
        taken += devices[0]["device_ids"]
    assert len(taken) == len(set(taken)), "two engines share a GPU"


def _flag(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def test_engine_services_are_wired_for_a_real_host(variant):
    services = variant.compose_data()["services"]
    engines = {name: s for name, s in services.items() if name.startswith("engine-")}
    assert engines
    for service in engines.values():
        assert service["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"  # passed through from the host
        cache = service["environment"]["HF_HOME"]
        assert f"${{HF_CACHE_DIR:-hf-cache}}:{cache}" in service["volumes"]
        # torch.compile's cache on a volume: a recreated container does not compile again.
        assert f"vllm-cache:{service['environment']['VLLM_CACHE_ROOT']}" in service["volumes"]
        assert service["ipc"] == "host"
        assert service["restart"] == "unless-stopped"
        check = service["healthcheck"]
        assert "/health" in " ".join(check["test"]) and ":8000/" in " ".join(check["test"])
        assert check["start_period"] in {"10m", "30m"}
    gateway = services["gateway"]
    assert gateway["depends_on"] == {name: {"condition": "service_started"} for name in engines}
    assert gateway["command"][:3] == ["serve", "--config", containers.GATEWAY_CONFIG_IN_CONTAINER]
    assert f"./{variant.gateway.name}:{containers.GATEWAY_CONFIG_IN_CONTAINER}:ro" in gateway["volumes"]
    upstreams = [  # by URL, or by the DNS name of a scaled service (one engine per replica)
        (model["name"], url)
        for model in variant.gateway_data()["models"]
        for url in model.get("urls", []) + [f"http://{name}" for name in model.get("dns", [])]
    ]
    assert sorted(upstreams) == sorted(
        (_flag(s["command"], "--served-model-name", ""), f"http://{name}:8000") for name, s in engines.items()
    )
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?")


# -- the renderer on configs made up for the purpose -----------------------------------------------
# They mirror the checkout: profiles under <tmp>/configs, the compose file in <tmp>/docker.

GPU_PROFILE = """\
model: org/model-{n}
served_model_name: {name}
device: gpu
replicas: {replicas}
vllm:
  tensor-parallel-size: {tp}
  max-model-len: 4096
"""


def write_config(tmp_path: Path, models: str, **profiles: str) -> Path:
    (tmp_path / "configs/profiles").mkdir(parents=True, exist_ok=True)
    for name, text in profiles.items():
        (tmp_path / f"configs/profiles/{name}.yaml").write_text(text)
    config = tmp_path / "configs/gateway.yaml"
    config.write_text("routing:\n  policy: round_robin\nmodels:\n" + models)
    return config


def test_replicas_get_consecutive_gpus_and_remote_engines_join(tmp_path):
    config = write_config(
        tmp_path,
        "  - profile: profiles/a.yaml\n  - profile: profiles/b.yaml\n"
        "  - name: far\n    urls: [http://10.0.0.7:8000/]\n",
        a=GPU_PROFILE.format(n=1, name="A.1", replicas=2, tp=2),
        b=GPU_PROFILE.format(n=2, name="b", replicas=1, tp=1),
    )
    output = tmp_path / "docker/compose.yaml"
    files = render(config, output)
    assert "# NVIDIA GPUs needed on this host: 5." in files[output]
    services = yaml.safe_load(files[output])["services"]
    assert {
        name: service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name, service in services.items()
        if "deploy" in service
    } == {"engine-a-1-0": ["0", "1"], "engine-a-1-1": ["2", "3"], "engine-b-0": ["4"]}
    gateway = yaml.safe_load(files[tmp_path / "docker/gateway.yaml"])
    assert gateway["routing"] == {"policy": "round_robin"}  # the operator's settings are kept
    assert gateway["models"] == [
        {
            "name": "A.1",
            "profile": "../configs/profiles/a.yaml",
            "urls": ["http://engine-a-1-0:8000", "http://engine-a-1-1:8000"],
        },
        {"name": "b", "profile": "../configs/profiles/b.yaml", "urls": ["http://engine-b-0:8000"]},
        {"name": "far", "urls": ["http://10.0.0.7:8000"]},
    ]
    prometheus = yaml.safe_load(files[tmp_path / "docker/prometheus.yml"])
    vllm_job = next(job for job in prometheus["scrape_configs"] if job["job_name"] == "vllm")
    assert {"targets": ["10.0.0.7:8000"], "labels": {"model": "far"}} in vllm_job["static_configs"]


def test_two_models_with_one_service_name_are_refused(tmp_path):
    config = write_config(
        tmp_path,
        "  - profile: profiles/a.yaml\n  - profile: profiles/b.yaml\n",
        a=GPU_PROFILE.format(n=1, name="m.1", replicas=1, tp=1),
        b=GPU_PROFILE.format(n=2, name="m-1", replicas=1, tp=1),
    )
    with pytest.raises(SettingsError, match="engine-m-1-0"):
        render(config, tmp_path / "docker/compose.yaml")


def test_a_profile_the_gateway_container_cannot_see_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/p.yaml").write_text(GPU_PROFILE.format(n=1, name="p", replicas=1, tp=1))
    config = write_config(tmp_path, "  - profile: ../elsewhere/p.yaml\n")
    with pytest.raises(compose.ComposeError, match="sees"):
        render(config, tmp_path / "docker/compose.yaml")


def test_the_tiny_model_is_refused_on_a_gpu_engine(tmp_path):
    text = (ROOT / "configs/profiles/tiny-cpu.yaml").read_text().replace("device: cpu", "device: gpu")
    config = write_config(
        tmp_path, "  - profile: profiles/tiny.yaml\n", tiny=text.replace("../../.cache", str(ROOT / ".cache"))
    )
    with pytest.raises(compose.ComposeError, match="CPU engine image"):
        render(config, tmp_path / "docker/compose.yaml")


def test_other_local_models_are_mounted_read_only_by_a_relative_path(tmp_path):
    (tmp_path / "weights/my-model").mkdir(parents=True)
    config = write_config(
        tmp_path,
        "  - profile: profiles/p.yaml\n",
        p="model: ../../weights/my-model\nserved_model_name: mine\ndevice: gpu\n",
    )
    files = render(config, tmp_path / "docker/compose.yaml")
    service = yaml.safe_load(files[tmp_path / "docker/compose.yaml"])["services"]["engine-mine-0"]
    assert service["command"][0] == "/models/my-model"
    assert "../weights/my-model:/models/my-model:ro" in service["volumes"]


def copy_variant(variant, tmp_path: Path) -> Path:
    """The variant's committed files in <tmp>/docker, with <tmp>/configs the checkout's configs."""
    (tmp_path / "docker").mkdir()
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for path in render(variant.config, variant.compose):
        shutil.copy(path, tmp_path / "docker" / path.name)
    return tmp_path / "docker" / variant.compose.name


def test_check_reports_drift_and_exit_1(tmp_path, capsys):
    variant = VARIANTS[1]
    output = copy_variant(variant, tmp_path)
    argv = ["compose", "--config", str(variant.config), "--output", str(output), "--check"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    output.write_text(output.read_text().replace("'2048'", "'4096'"))
    capsys.readouterr()
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(r"^-\s+- '4096'$", err, re.MULTILINE) and re.search(r"^\+\s+- '2048'$", err, re.MULTILINE)
    assert "make compose" in err
    output.write_text(variant.compose.read_text())
    (tmp_path / "docker/gateway.cpu.yaml").unlink()  # the companion files are checked too
    assert cli_main(argv) == 1


def test_output_writes_all_three_files(tmp_path):
    variant = VARIANTS[0]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    output = tmp_path / "docker/compose.yaml"
    assert cli_main(["compose", "--config", str(variant.config), "--output", str(output)]) == 0
    for path in render(variant.config, variant.compose):
        assert (tmp_path / "docker" / path.name).read_text() == path.read_text()


def test_the_rendered_gateway_config_loads_with_its_profiles(variant):
    settings = load_settings(variant.gateway)  # what `serve --config` reads in the container
    source = load_settings(variant.config)
    assert settings.timeouts == source.timeouts and settings.routing == source.routing
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    rendered = plan_deployment(settings.models, config=variant.gateway).models
    planned = plan_deployment(source.models, config=variant.config).models
    assert [m.name for m in rendered] == [m.name for m in planned]
    for model, expected in zip(rendered, planned):
        engines = model.urls + [f"http://{name}" for name in model.entry.dns]  # by URL or by DNS name
        assert engines and all(url.startswith("http://engine-") for url in engines)
        assert model.entry.dns == expected.entry.dns
        assert model.profile is not None and expected.profile is not None
        assert model.profile.source == expected.profile.source


def test_an_engine_over_several_nodes_is_refused_naming_the_helm_chart(tmp_path):
    """Compose runs one host; a data-parallel engine over two nodes runs as a LeaderWorkerSet (Helm)."""
    two_nodes = (
        GPU_PROFILE.format(n=1, name="big", replicas=1, tp=1)
        + "  data-parallel-size: 16\n  data-parallel-size-local: 8\n"
    )
    config = write_config(tmp_path, "  - profile: profiles/big.yaml\n", big=two_nodes)
    with pytest.raises(compose.ComposeError, match="spans 2 nodes.*Helm chart"):
        render(config, tmp_path / "docker/compose.yaml")


def test_a_data_parallel_engine_is_pinned_every_gpu_of_its_node(tmp_path):
    dp8 = GPU_PROFILE.format(n=1, name="dp", replicas=1, tp=1) + "  data-parallel-size: 8\n"
    config = write_config(tmp_path, "  - profile: profiles/dp.yaml\n", dp=dp8)
    (engine,) = plan_deployment(load_settings(config).models, config=config, placement="services").engines
    assert engine.gpus == tuple(range(8))
