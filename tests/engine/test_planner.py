"""KV-cache arithmetic against values computed by hand."""

import json

import pytest

from server.cli import main as cli_main
from server.engine.kv import capacity, kv_layout, sequence_bytes
from server.engine.planner import PlanError, estimate_weight_bytes, parse_size, plan_profile
from server.engine.profiles import load_profile, profiles_dir
from server.engine.weights import model_shape, parameter_count

LLAMA2_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
    torch_dtype="float16",
)
LLAMA3_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    torch_dtype="bfloat16",
)
DEEPSEEK_V3 = dict(
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    torch_dtype="bfloat16",
)
MISTRAL_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    sliding_window=4096,
    torch_dtype="bfloat16",
)
GEMMA2_LIKE = dict(
    hidden_size=2304,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=4096,
    torch_dtype="bfloat16",
    layer_types=["sliding_attention", "full_attention"] * 2,
)


def test_mha_llama2():
    layout = kv_layout(LLAMA2_7B)
    assert layout.attention == "mha"
    assert layout.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert layout.textbook_bytes_per_token == layout.bytes_per_token


def test_gqa_uses_kv_heads_not_attention_heads():
    layout = kv_layout(LLAMA3_8B)
    assert layout.attention == "gqa"
    assert layout.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert layout.textbook_bytes_per_token == 4 * layout.bytes_per_token


def test_fp8_halves_the_cache():
    assert kv_layout(LLAMA3_8B, "fp8").bytes_per_token == 65_536
    assert kv_layout(LLAMA3_8B, "fp8_e5m2").dtype_bytes == 1
    assert kv_layout(LLAMA3_8B, "float16").dtype_bytes == 2


def test_mla_caches_the_latent():
    layout = kv_layout(DEEPSEEK_V3)
    assert layout.attention == "mla"
    assert layout.bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    # all 128 heads with K (128+64) and V (128) dims:
    assert layout.textbook_bytes_per_token == 61 * 128 * (192 + 128) * 2 == 4_997_120


def test_sliding_window_every_layer():
    layout = kv_layout(MISTRAL_7B)
    assert (layout.sliding_window, layout.sliding_window_layers) == (4096, 32)
    per_token = 2 * 32 * 8 * 128 * 2
    assert sequence_bytes(layout, 1000) == 1000 * per_token
    assert sequence_bytes(layout, 32_768) == 4096 * per_token  # capped at the window


def test_sliding_window_alternating_layers():
    layout = kv_layout(GEMMA2_LIKE)
    assert layout.sliding_window_layers == 2 and layout.full_attention_layers == 2
    per_layer = 2 * 4 * 256 * 2
    assert sequence_bytes(layout, 10_000) == per_layer * (2 * 10_000 + 2 * 4096)


def test_qwen2_window_off_unless_used():
    layout = kv_layout(dict(LLAMA3_8B, sliding_window=131072, use_sliding_window=False))
    assert layout.sliding_window is None


def test_capacity_in_whole_blocks():
    layout = kv_layout(
        dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16")
    )
    assert layout.bytes_per_token == 1024
    blocks, tokens, seqs = capacity(layout, 2**30, 128, 2048)
    assert (blocks, tokens, seqs) == (8192, 1_048_576, 512)
    # 1000 bytes short of a block: one block less
    assert capacity(layout, 128 * 1024 * 10 - 1000, 128, 2048)[0] == 9
    assert capacity(layout, 128 * 1024 * 10, 128, 2048)[2] == 0  # 10 blocks < 16 per sequence


def test_weight_estimates_match_published_sizes():
    assert estimate_weight_bytes(LLAMA3_8B) / 2 == pytest.approx(8.03e9, rel=0.01)
    assert estimate_weight_bytes(LLAMA2_7B) / 2 == pytest.approx(6.74e9, rel=0.01)
    shipped = json.loads((profiles_dir().parent / "models" / "deepseek-ai--DeepSeek-V3" / "config.json").read_text())
    params = parameter_count(model_shape(shipped))
    assert params == pytest.approx(671e9, rel=0.005)
    # Its own fp8 weights: 1 byte a weight (+ an fp32 scale per 128x128 block), embedding and head in bf16.
    embeddings = 2 * 129280 * 7168
    assert estimate_weight_bytes(shipped) == pytest.approx((params - embeddings) + 2 * embeddings, rel=0.002)
    unquantized = {k: v for k, v in shipped.items() if k != "quantization_config"}
    assert estimate_weight_bytes(unquantized) == pytest.approx(2 * params, rel=0.001)


def test_parse_size():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("24GB") == 24_000_000_000
    assert parse_size("512 MiB") == 512 * 2**20
    with pytest.raises(PlanError):
        parse_size("lots")


def test_tiny_cpu_plan_uses_kvcache_space():
    plan = plan_profile(
        load_profile(profiles_dir() / "tiny-cpu.yaml"),
        config=dict(
            hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16"
        ),
    )
    assert plan.kv_memory_bytes == 2**30
    assert plan.kv_cache_tokens == 1_048_576
    assert plan.max_concurrent_sequences == 512


def test_gpu_plan_needs_device_memory_and_subtracts_weights():
    profile = load_profile(profiles_dir() / "chat-fp8.yaml")
    with pytest.raises(PlanError, match="--device-memory"):
        plan_profile(profile)
    plan = plan_profile(profile, parse_size("80GiB"))
    weights = estimate_weight_bytes(LLAMA3_8B)
    expected_memory = int(80 * 2**30 * 0.90 - weights - 1.5 * 2**30)
    assert plan.kv_memory_bytes == pytest.approx(expected_memory, abs=1)
    assert plan.kv_bytes_per_token == 65_536
    assert plan.num_blocks == expected_memory // (65_536 * 16)
    assert plan.max_concurrent_sequences == plan.num_blocks // (8192 // 16)


def test_plan_command_json(capsys):
    assert cli_main(["plan", "chat-fp8", "--device-memory", "80GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"kv_bytes_per_token", "kv_cache_tokens", "max_concurrent_sequences"} <= data.keys()
    assert cli_main(["plan", "chat-fp8"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def _profile_file(tmp_path, text: str):
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(text)
    return load_profile(path)


def test_a_model_too_big_for_one_gpu_names_the_smallest_tensor_parallel_size(tmp_path, capsys):
    profile = _profile_file(
        tmp_path,
        "name: big\nmodel: meta-llama/Meta-Llama-3-70B-Instruct\nserved_model_name: big\ndevice: gpu\n"
        "vllm:\n  max-model-len: 8192\n",
    )
    plan = plan_profile(profile, parse_size("141GiB"))
    assert plan.max_concurrent_sequences == 0
    tp = plan.min_tensor_parallel_size
    assert tp is not None and tp >= 2
    # The size it names does hold a sequence, and one less does not.
    bigger = _profile_file(
        tmp_path,
        "name: big\nmodel: meta-llama/Meta-Llama-3-70B-Instruct\nserved_model_name: big\ndevice: gpu\n"
        f"vllm:\n  max-model-len: 8192\n  tensor-parallel-size: {tp}\n",
    )
    assert plan_profile(bigger, parse_size("141GiB")).max_concurrent_sequences >= 1
    if tp > 2:
        smaller = _profile_file(
            tmp_path,
            "name: big\nmodel: meta-llama/Meta-Llama-3-70B-Instruct\nserved_model_name: big\ndevice: gpu\n"
            f"vllm:\n  max-model-len: 8192\n  tensor-parallel-size: {tp - 1}\n",
        )
        assert plan_profile(smaller, parse_size("141GiB")).max_concurrent_sequences == 0
    assert cli_main(["plan", str(profile.source), "--device-memory", "141GiB"]) == 0
    assert f"needs tensor-parallel-size >= {tp}" in capsys.readouterr().out
    assert (
        plan_profile(load_profile(profiles_dir() / "chat-fp8.yaml"), parse_size("80GiB")).min_tensor_parallel_size
        is None
    )


def test_the_tiny_model_plans_before_it_is_built(tmp_path):
    profile = _profile_file(
        tmp_path,
        "name: t\nmodel: ./not-built-yet\nserved_model_name: tiny\n"
        "build_tiny_model: true\ndevice: cpu\nenv:\n  VLLM_CPU_KVCACHE_SPACE: '1'\n",
    )
    assert not (tmp_path / "not-built-yet").exists()
    plan = plan_profile(profile)
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2  # K and V x 2 layers x 2 KV heads x 64 dims x bf16
    assert plan.kv_cache_tokens == 1_048_576
