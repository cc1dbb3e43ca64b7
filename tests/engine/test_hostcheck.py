"""The host check refuses what cannot run here, before anything starts."""

import asyncio
import sys
from pathlib import Path

import pytest

from server.engine.hostcheck import HostInfo, check_profile, model_max_len
from server.engine.profiles import load_profile, profiles_dir
from server.engine.supervisor import EngineStartError, EngineSupervisor
from tests.support import free_port

AVX2 = HostInfo("x86_64", frozenset({"sse4_2", "avx", "avx2", "fma"}), 0)
AVX512 = HostInfo("x86_64", frozenset({"avx2", "avx512f", "avx512_bf16"}), 0)
AMX = HostInfo("x86_64", frozenset({"avx2", "amx_tile", "amx_bf16"}), 0)
OLD_CPU = HostInfo("x86_64", frozenset({"sse4_2", "avx"}), 0)
ONE_GPU = HostInfo("x86_64", frozenset({"avx2"}), 1)


def profile(name):
    return load_profile(profiles_dir() / f"{name}.yaml")


def tiny_profile(
    tmp_path: Path, extra_vllm: str = "", env: str = "  VLLM_CPU_KVCACHE_SPACE: '1'\n", dtype: str = "auto"
) -> object:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        '{"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}'
    )
    path = tmp_path / "p.yaml"
    path.write_text(
        f"model: ./model\nserved_model_name: t\ndevice: cpu\nenv:\n{env}"
        f"vllm:\n  kv-cache-dtype: {dtype}\n  block-size: 128\n{extra_vllm}"
    )
    return load_profile(path)


def test_tiny_cpu_runs_on_avx2(tmp_path):
    assert check_profile(tiny_profile(tmp_path, "  max-model-len: 2048\n"), AVX2) == []


def test_fp8_kv_on_avx2_is_refused_with_the_reason(tmp_path):
    problems = check_profile(tiny_profile(tmp_path, dtype="fp8"), AVX2)
    assert len(problems) == 1
    assert "AVX-512 or AMX" in problems[0] and "fp8" in problems[0]


def test_fp8_kv_on_avx512_or_amx_is_allowed(tmp_path):
    assert check_profile(tiny_profile(tmp_path, dtype="fp8"), AVX512) == []
    assert check_profile(tiny_profile(tmp_path, dtype="fp8_e5m2"), AMX) == []


def test_cpu_without_avx2_is_refused(tmp_path):
    assert any("AVX2" in p for p in check_profile(tiny_profile(tmp_path), OLD_CPU))


def test_gpu_profile_without_gpu():
    problems = check_profile(profile("chat-fp8"), AVX2)
    assert any("no NVIDIA GPU" in p for p in problems)
    assert check_profile(profile("chat-fp8"), ONE_GPU) == []


def test_tensor_parallel_needs_enough_gpus(tmp_path):
    path = tmp_path / "tp.yaml"
    path.write_text("model: org/m\nserved_model_name: m\nvllm:\n  tensor-parallel-size: 4\n")
    problems = check_profile(load_profile(path), ONE_GPU)
    assert any("4 GPUs; this host has 1" in p for p in problems)


def test_missing_model_path(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: ./nowhere\nserved_model_name: m\ndevice: cpu\n")
    assert any("does not exist" in p for p in check_profile(load_profile(path), AVX2))


def test_max_model_len_above_the_models_limit(tmp_path):
    problems = check_profile(tiny_profile(tmp_path, "  max-model-len: 8192\n"), AVX2)
    assert any("above the model's limit of 4096" in p for p in problems)


def test_kv_memory_too_small_for_one_sequence(tmp_path):
    # 1 MiB at 1024 B/token = 1024 tokens < one 4096-token sequence
    small = tiny_profile(tmp_path, "  max-model-len: 4096\n", env="  VLLM_CPU_KVCACHE_SPACE: '0.0009765625'\n")
    problems = check_profile(small, AVX2)
    assert any("cannot hold one sequence" in p for p in problems)


def test_rope_scaling_extends_the_limit():
    assert model_max_len({"max_position_embeddings": 32768}) == 32768
    assert (
        model_max_len(
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            }
        )
        == 131072
    )


def test_detect_reads_this_machine(monkeypatch):
    monkeypatch.delenv("SERVER_HOST_CPU_FLAGS", raising=False)
    host = HostInfo.detect()
    assert host.machine
    monkeypatch.setenv("SERVER_HOST_CPU_FLAGS", "avx2, fma")
    assert HostInfo.detect().cpu_flags == {"avx2", "fma"}


# -- AMX hosts (docs/operate/cpu-hosts.md) -------------------------------------------------------


def test_the_embed_profile_keeps_amx_out_of_its_engine_and_runs_on_every_cpu():
    embed = profile("tiny-embed")
    assert embed.env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # oneDNN's ceiling: no AMX
    assert embed.vllm["dtype"] == "float32"  # vLLM's own AMX kernels are bfloat16 only
    for host in (AVX2, AVX512, AMX):  # a ceiling: AVX2 and AMD hosts run what they have
        assert check_profile(embed, host) == []


def test_the_chat_profiles_leave_onednn_free_to_ask_for_amx():
    """With bfloat16, vLLM's CPU attention runs AMX tiles on an AMX host without asking Linux for
    the permission; oneDNN asks for it (process-wide). Capping oneDNN below AMX there would leave
    nobody asking: every such profile keeps oneDNN uncapped."""
    for path in sorted(profiles_dir().glob("tiny-*.yaml")):
        tiny = load_profile(path)
        if tiny.vllm.get("dtype") == "bfloat16":
            assert "ONEDNN_MAX_CPU_ISA" not in tiny.env, path.name


def test_the_embed_profiles_env_reaches_the_engine_process():
    """The supervisor starts the engine with the profile's env: a stand-in engine prints it."""
    embed = profile("tiny-embed")
    probe = [sys.executable, "-c", "import os; print('oneDNN cap:', os.environ.get('ONEDNN_MAX_CPU_ISA'))"]

    async def run() -> list[str]:
        supervisor = EngineSupervisor(embed, port=free_port(), argv=probe, max_restarts=0, ready_timeout=60)
        await supervisor.start()
        with pytest.raises(EngineStartError):  # it printed and exited: not an engine
            await supervisor.wait_ready()
        await supervisor.stop()
        return list(supervisor.last_lines)

    assert "oneDNN cap: AVX512_CORE_BF16" in asyncio.run(run())
