"""LoRA adapters in profiles: validated, rendered to vLLM's flags, and the tiny adapter built offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from server.engine.profiles import ProfileError, load_profile
from server.engine.render import engine_argv, engine_config
from server.engine.tinyadapter import RANK, build_tiny_adapter
from server.engine.tinymodel import MODEL_SHAPE

ROOT = Path(__file__).resolve().parents[2]


def test_the_lora_profile_renders_enable_lora_and_absolute_module_paths():
    profile = load_profile(ROOT / "configs/profiles/tiny-cpu-lora.yaml")
    argv = engine_argv(profile, port=8100)
    assert "--enable-lora" in argv
    module = argv[argv.index("--lora-modules") + 1]
    assert module == f"tiny-travel={(ROOT / '.cache/tiny-lora').resolve()}"
    config = engine_config(profile)
    assert config["enable-lora"] is True and config["lora-modules"] == [module]
    assert profile.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"


def test_profiles_without_adapters_render_no_lora_flags():
    argv = engine_argv(load_profile(ROOT / "configs/profiles/tiny-cpu.yaml"), port=8100)
    assert "--enable-lora" not in argv and "--lora-modules" not in argv


@pytest.mark.parametrize(
    "adapters, problem",
    [
        ([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], "share a name"),
        ([{"name": "tiny", "path": "/x"}], "named like the served model"),
        ([{"name": "a", "path": "/x", "rank": 8}], "unknown key"),
    ],
)
def test_bad_adapter_declarations_are_refused(tmp_path, adapters, problem):
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"model": "/m", "served_model_name": "tiny", "lora_adapters": adapters}))
    with pytest.raises(ProfileError, match=problem):
        load_profile(path)


def test_the_tiny_adapter_is_peft_shaped_and_the_same_every_time(tmp_path):
    one = build_tiny_adapter(tmp_path / "one", log=lambda _: None)
    two = build_tiny_adapter(tmp_path / "two", log=lambda _: None)
    weights = (one / "adapter_model.safetensors").read_bytes()
    assert weights == (two / "adapter_model.safetensors").read_bytes()
    config = json.loads((one / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", RANK, ["q_proj", "v_proj"])
    tensors = load_file(str(one / "adapter_model.safetensors"))
    layers = MODEL_SHAPE["num_hidden_layers"]
    assert len(tensors) == layers * 2 * 2  # q and v, A and B, per layer
    hidden = MODEL_SHAPE["hidden_size"]
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (RANK, hidden)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (128, RANK)
