"""The deployment plan: one expansion of a config's models into engines, for every launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import ModelEngines, SettingsError, TrimmingConfig, parse_upstreams
from server.deploy.plan import plan_deployment
from server.gateway.settings import load_settings

CPU_PROFILE = "model: /m\nserved_model_name: {name}\nreplicas: {replicas}\ndevice: cpu\n"
GPU_PROFILE = (
    "model: org/m\nserved_model_name: {name}\nreplicas: {replicas}\ndevice: gpu\nvllm:\n  tensor-parallel-size: {tp}\n"
)


def write(tmp_path: Path, models: str, **profiles: str) -> Path:
    for name, text in profiles.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    config = tmp_path / "g.yaml"
    config.write_text("models:\n" + models)
    return config


def plan_of(config: Path, **kwargs):
    return plan_deployment(load_settings(config).models, config=config, **kwargs)


def test_url_only_models_are_served_as_given():
    plan = plan_deployment(parse_upstreams(["a=http://h:1", "a=http://h:2/", "b=https://x"]))
    assert plan.engines == []
    assert [(m.name, m.urls, m.trimming.mode) for m in plan.served_models()] == [
        ("a", ["http://h:1", "http://h:2"], "off"),
        ("b", ["https://x"], "off"),
    ]
    for model in plan.served_models():  # nothing to read the figures from: the engines report theirs
        assert (model.max_model_len, model.block_size, model.planned_kv_tokens) == (None, None, None)


def test_profile_models_get_consecutive_ports(tmp_path):
    config = write(
        tmp_path,
        "  - profile: p.yaml\n    base_port: 9100\n  - name: u\n    urls: [http://e:1]\n  - profile: q.yaml\n",
        p=CPU_PROFILE.format(name="pm", replicas=2),
        q=CPU_PROFILE.format(name="qm", replicas=1),
    )
    served = plan_of(config).served_models()
    assert [(m.name, m.urls, m.trimming.mode) for m in served] == [
        ("pm", ["http://127.0.0.1:9100", "http://127.0.0.1:9101"], "auto"),
        ("u", ["http://e:1"], "off"),
        ("qm", ["http://127.0.0.1:9102"], "auto"),
    ]  # no base_port: after the previous model's
    assert (served[0].max_model_len, served[0].block_size) == (None, 128)  # the CPU platform's default


def test_the_gateway_gets_the_profiles_figures_as_plain_data(tmp_path):
    """max_model_len, block size and planned KV tokens are worked out here: the gateway reads no profile."""
    profile = CPU_PROFILE.format(name="pm", replicas=1) + "vllm:\n  max-model-len: 2048\n  block-size: 64\n"
    config = write(tmp_path, "  - profile: p.yaml\n  - profile: q.yaml\n    planned_kv_tokens: 5000\n", p=profile,
                   q=CPU_PROFILE.format(name="qm", replicas=1))  # fmt: skip
    pm, qm = plan_of(config).served_models()
    assert (pm.max_model_len, pm.block_size) == (2048, 64)
    assert pm.planned_kv_tokens is None  # /m has no config.json to plan from: unknown, not a guess
    assert qm.planned_kv_tokens == 5000  # the config's figure (the renderers write it)
    assert not hasattr(pm, "profile")


def test_without_base_port_engines_start_at_8100(tmp_path):
    config = write(tmp_path, "  - profile: p.yaml\n", p=CPU_PROFILE.format(name="pm", replicas=2))
    assert [e.port for e in plan_of(config).engines] == [8100, 8101]


def test_entries_of_one_name_are_replicas_of_one_model(tmp_path):
    config = write(
        tmp_path,
        "  - profile: p.yaml\n  - name: pm\n    urls: [http://other:8000/]\n    trimming: {mode: strict}\n",
        p=CPU_PROFILE.format(name="pm", replicas=1),
    )
    (served,) = plan_of(config).served_models()
    assert served.urls == ["http://127.0.0.1:8100", "http://other:8000"]
    assert served.trimming.mode == "auto"  # the first entry's (its profile's) settings
    assert served.block_size == 128  # and its profile's figures


def test_a_profile_entry_with_urls_names_engines_that_run_elsewhere(tmp_path):
    """What compose's gateway config says: the profile for trimming and capacity, the services' URLs."""
    config = write(
        tmp_path,
        "  - profile: p.yaml\n    urls: [http://engine-pm-0:8000/]\n  - profile: q.yaml\n",
        p=CPU_PROFILE.format(name="pm", replicas=2),
        q=CPU_PROFILE.format(name="qm", replicas=1),
    )
    plan = plan_of(config)
    assert [(e.model, e.port) for e in plan.engines] == [("qm", 8100)]  # nothing started for pm
    assert [(m.name, m.urls, m.trimming.mode) for m in plan.served_models()] == [
        ("pm", ["http://engine-pm-0:8000"], "auto"),
        ("qm", ["http://127.0.0.1:8100"], "auto"),
    ]


def test_a_second_entry_of_a_model_continues_its_replica_numbers(tmp_path):
    config = write(
        tmp_path,
        "  - profile: p.yaml\n  - profile: p.yaml\n    base_port: 9000\n",
        p=CPU_PROFILE.format(name="pm", replicas=2),
    )
    plan = plan_of(config, placement="services")
    assert [(e.replica, e.service, e.url) for e in plan.engines] == [
        (0, "engine-pm-0", "http://engine-pm-0:8000"),
        (1, "engine-pm-1", "http://engine-pm-1:8000"),
        (2, "engine-pm-2", "http://engine-pm-2:8000"),
        (3, "engine-pm-3", "http://engine-pm-3:8000"),
    ]
    assert [e.port for e in plan_of(config).engines] == [8100, 8101, 9000, 9001]


def test_gpu_engines_get_gpus_of_their_own_in_order(tmp_path):
    config = write(
        tmp_path,
        "  - profile: a.yaml\n  - profile: c.yaml\n  - profile: b.yaml\n",
        a=GPU_PROFILE.format(name="A.1", replicas=2, tp=2),
        c=CPU_PROFILE.format(name="c", replicas=1),
        b=GPU_PROFILE.format(name="b", replicas=1, tp=1),
    )
    plan = plan_of(config)
    assert [(e.service, e.gpus) for e in plan.engines] == [
        ("engine-a-1-0", (0, 1)),
        ("engine-a-1-1", (2, 3)),
        ("engine-c-0", ()),
        ("engine-b-0", (4,)),
    ]
    assert plan.gpu_count == 5


def test_two_models_with_one_service_name_are_refused(tmp_path):
    config = write(
        tmp_path,
        "  - profile: a.yaml\n  - profile: b.yaml\n",
        a=CPU_PROFILE.format(name="m.1", replicas=1),
        b=CPU_PROFILE.format(name="m-1", replicas=1),
    )
    with pytest.raises(SettingsError, match="engine-m-1-0"):
        plan_of(config)


def test_a_broken_profile_is_refused_with_the_config_named(tmp_path):
    config = write(tmp_path, "  - profile: missing.yaml\n")
    with pytest.raises(SettingsError, match=r"g\.yaml: .*missing\.yaml: no such profile file"):
        plan_of(config)


def test_an_entry_trimming_overrides_its_profile():
    entry = ModelEngines(name="u", urls=["http://e:1"], trimming=TrimmingConfig(mode="strict"))
    (served,) = plan_deployment([entry]).served_models()
    assert served.trimming.mode == "strict"
