"""Profiles load into a typed model; every bad file is refused with file, key and expectation."""

from pathlib import Path

import pytest

from server.engine.profiles import ProfileError, load_profile, profiles_dir, resolve_profile_path

SHIPPED = sorted(profiles_dir().glob("*.yaml"))

VALID = """\
model: meta-llama/Llama-3.1-8B-Instruct
served_model_name: chat
vllm:
  max-model-len: 8192
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_profiles_load():
    names = {path.stem for path in SHIPPED}
    assert {"tiny-cpu", "chat-fp8", "rag-prefix", "long-context"} <= names
    for path in SHIPPED:
        profile = load_profile(path)
        assert profile.name == path.stem
        assert profile.served_model_name


def test_chat_fp8_is_the_seed_profile():
    profile = load_profile(profiles_dir() / "chat-fp8.yaml")
    assert profile.kv_cache_dtype == "fp8"
    assert profile.vllm["enable-prefix-caching"] is True
    assert profile.max_model_len == 8192
    assert profile.gpu_memory_utilization == 0.90
    assert profile.device == "gpu"


def test_long_context_is_32k():
    assert load_profile(profiles_dir() / "long-context.yaml").max_model_len == 32768


def test_minimal_profile_defaults(tmp_path):
    profile = load_profile(write(tmp_path, VALID))
    assert profile.replicas == 1
    assert profile.block_size == 16  # vLLM's GPU default
    assert profile.kv_cache_dtype == "auto"
    assert profile.model_path is None  # a hub id
    assert profile.trimming.mode == "auto"


def test_local_model_path_resolves_against_the_profile_file(tmp_path):
    text = VALID.replace("meta-llama/Llama-3.1-8B-Instruct", "../models/tiny")
    sub = tmp_path / "profiles"
    sub.mkdir()
    profile = load_profile(write(sub, text))
    assert profile.model_path == (tmp_path / "models" / "tiny").resolve()


def test_bare_profile_name_resolves_to_configs_profiles():
    assert resolve_profile_path("tiny-cpu") == profiles_dir() / "tiny-cpu.yaml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VALID + "replica: 2\n", "replica: unknown key"),
        (VALID + "replicas: two\n", "replicas:"),
        (VALID + "replicas: 0\n", "replicas:"),
        (VALID.replace("served_model_name: chat\n", ""), "served_model_name: required key is missing"),
        (VALID + "  block-size: 17\n", "vllm.block-size: expected a power of two, got 17"),
        (VALID + "  block-size: '16'\n", "vllm.block-size: expected a power of two, got '16'"),
        (VALID + "  gpu-memory-utilization: 1.5\n", "vllm.gpu-memory-utilization: expected a fraction"),
        (VALID + "  kv-cache-dtype: fp4\n", "vllm.kv-cache-dtype: expected one of"),
        (VALID + "  enable-prefix-caching: 'yes'\n", "vllm.enable-prefix-caching: expected true or false"),
        (VALID.replace("max-model-len: 8192", "max-model-len: -1"), "vllm.max-model-len: expected a positive"),
        (VALID + "  max_num_seqs: 8\n", "vllm.max_num_seqs: expected vLLM's long flag name"),
        (VALID + "  --max-num-seqs: 8\n", "expected vLLM's long flag name"),
        (VALID + "  port: 9000\n", "vllm.port: set by the launcher"),
        (VALID + "device: tpu\n", "device:"),
        (VALID + "env:\n  FLAG: true\n", "env.FLAG: expected a string or number"),
        (VALID + "env:\n  VLLM_CPU_KVCACHE_SPACE: lots\n", "VLLM_CPU_KVCACHE_SPACE: expected a positive"),
        (VALID + "trimming:\n  mode: sometimes\n", "trimming.mode:"),
        (VALID + "build_tiny_model: true\n", "build_tiny_model: needs `model` to be a local path"),
        ("- a\n- list\n", "expected a mapping of profile keys, got list"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_profiles_are_refused_with_file_key_and_expectation(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert expected in message, message


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "nope.yaml")


def test_unknown_vllm_flags_pass_through(tmp_path):
    profile = load_profile(write(tmp_path, VALID + "  speculative-config: {method: ngram}\n"))
    assert profile.vllm["speculative-config"] == {"method": "ngram"}
