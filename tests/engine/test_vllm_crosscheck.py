"""The planner against vLLM itself: per-rank KV heads, layers and bytes, over published configs.

vLLM's own `ModelConfig` and `ParallelConfig` are built from each config.json in a subprocess
(tests/engine/vllm_probe.py: no GPU, no weights, about 30 s for the table), with the KV-cache
spec classes its attention layers hand the allocator; the Transformers model of each config is
built on the meta device for its parameter count; vLLM's quantization config classes read
each `quantization_config`. The planner's figures must agree for every case: dense MHA, GQA
with fewer KV heads than ranks, MLA under tensor parallelism, sliding windows, MoE, pipeline
stages with an uneven split, and the quantized formats.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from server.engine.kv import kv_layout, rank_layout
from server.engine.parallel import Layout
from server.engine.quantization import QuantizationError, weight_format
from server.engine.weights import model_shape, parameter_count

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs/models"


def shipped(name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((SHIPPED / name / "config.json").read_text())
    return config


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5}

# Published config.json files (the fields that matter to vLLM, as released on the model pages).
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "rope_theta": 10000.0,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
    "vocab_size": 256000,
    "torch_dtype": "float32",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "vocab_size": 201088,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
}
LLAMA31_8B = shipped("meta-llama--Llama-3.1-8B-Instruct")
AWQ = {
    "bits": 4,
    "group_size": 128,
    "modules_to_not_convert": None,
    "quant_method": "awq",
    "version": "gemm",
    "zero_point": True,
}
GPTQ = {
    "bits": 4,
    "damp_percent": 0.01,
    "desc_act": False,
    "group_size": 128,
    "quant_method": "gptq",
    "sym": True,
    "true_sequential": True,
}
W4A16 = {
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 128,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head"],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
BNB_4BIT = {
    "_load_in_4bit": True,
    "_load_in_8bit": False,
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8",
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "llm_int8_skip_modules": None,
    "llm_int8_threshold": 6.0,
    "load_in_4bit": True,
    "load_in_8bit": False,
    "quant_method": "bitsandbytes",
}

# name: (config, layout, kv-cache-dtype, block size, count parameters with Transformers)
CASES: dict[str, tuple[dict[str, Any], Layout, str, int, bool]] = {
    "llama2-7b-mha-tp2": (shipped("meta-llama--Llama-2-7b-hf"), Layout(tp=2), "auto", 16, True),
    "llama3-70b-gqa-tp16-kv8": (shipped("meta-llama--Meta-Llama-3-70B-Instruct"), Layout(tp=16), "fp8", 16, False),
    "llama3-70b-gqa-tp8-pp3": (shipped("meta-llama--Meta-Llama-3-70B-Instruct"), Layout(tp=8, pp=3), "auto", 16, True),
    "qwen2.5-7b-gqa-tp8-kv4": (shipped("Qwen--Qwen2.5-7B-Instruct"), Layout(tp=8), "auto", 16, False),
    "deepseek-v3-mla-tp8-fp8": (shipped("deepseek-ai--DeepSeek-V3"), Layout(tp=8), "fp8", 64, True),
    "deepseek-v3-mla-tp8-pp2-fp8-ds-mla": (
        shipped("deepseek-ai--DeepSeek-V3"),
        Layout(tp=8, pp=2),
        "fp8_ds_mla",
        64,
        False,
    ),
    "deepseek-v3-mla-dp8-ep": (shipped("deepseek-ai--DeepSeek-V3"), Layout(dp=8, ep=True), "auto", 64, False),
    "mistral-7b-sliding-tp4": (MISTRAL_7B, Layout(tp=4), "auto", 16, True),
    "gemma2-9b-alternating-window-tp16": (GEMMA2_9B, Layout(tp=16), "auto", 16, False),
    "mixtral-8x7b-moe-tp8-pp2": (MIXTRAL_8X7B, Layout(tp=8, pp=2), "auto", 16, True),
    "qwen3-30b-a3b-moe-tp8-kv4": (QWEN3_30B_A3B, Layout(tp=8), "fp8", 16, True),
    "gpt-oss-20b-mxfp4-sliding-tp4": (GPT_OSS_20B, Layout(tp=4), "auto", 16, False),
    "llama3.1-8b-awq-tp2": (
        {**LLAMA31_8B, "quantization_config": AWQ, "torch_dtype": "float16"},
        Layout(tp=2),
        "auto",
        16,
        False,
    ),
    "qwen2.5-7b-gptq-int4-tp4": (
        {**shipped("Qwen--Qwen2.5-7B-Instruct"), "quantization_config": GPTQ, "torch_dtype": "float16"},
        Layout(tp=4),
        "auto",
        16,
        False,
    ),
    "llama3.1-8b-w4a16-compressed-tensors": (
        {**LLAMA31_8B, "quantization_config": W4A16},
        Layout(tp=1),
        "auto",
        16,
        False,
    ),
}


BNB_CASE = "llama3.1-8b-bnb-4bit"


@pytest.fixture(scope="module")
def vllm_says() -> dict[str, dict[str, Any]]:
    cases = [
        {
            "name": name,
            "config": config,
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "ep": layout.ep,
            "kv_cache_dtype": kv_dtype,
            "block_size": block,
            "count_parameters": count,
        }
        for name, (config, layout, kv_dtype, block, count) in CASES.items()
    ]
    cases.append({"name": BNB_CASE, "config": {**LLAMA31_8B, "quantization_config": BNB_4BIT}})
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_probe.py"))],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {entry["name"]: entry for entry in json.loads(result.stdout)}


@pytest.mark.parametrize("name", CASES)
def test_per_rank_kv_cache_matches_vllm(name, vllm_says):
    config, layout, kv_dtype, block, _ = CASES[name]
    seen = vllm_says[name]
    assert "error" not in seen, seen.get("error")
    whole = kv_layout(config, kv_dtype)
    assert (whole.attention == "mla") == seen["use_mla"]
    assert len(seen["ranks"]) == layout.pp
    for stage, rank in enumerate(seen["ranks"]):
        mine = rank_layout(whole, layout, stage)
        start, end = rank["layers"]
        assert mine.layers == end - start == rank["attention_layers"]
        assert (mine.kv_heads or 1) == rank["kv_heads"]  # MLA: vLLM counts its latent as one head
        assert mine.head_dim == rank["head_size"]
        # vLLM's spec gives one layer's page; the rank holds `layers` of them.
        assert mine.layer_bytes_per_token * block == rank["page_size_bytes"]
        assert mine.bytes_per_token == rank["page_size_bytes"] // block * rank["attention_layers"]


@pytest.mark.parametrize("name", CASES)
def test_sliding_window_layers_match_vllm(name, vllm_says):
    config, _, kv_dtype, _, _ = CASES[name]
    seen = vllm_says[name]
    whole = kv_layout(config, kv_dtype)
    assert whole.sliding_window == seen["sliding_window"]
    assert list(whole.sliding) == seen["sliding"]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[4]])
def test_parameter_count_matches_transformers(name, vllm_says):
    config = CASES[name][0]
    # Exact for these architectures: biases, sinks and rotary buffers are what the count leaves out.
    assert parameter_count(model_shape(config)) == vllm_says[name]["parameters"]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if "quantization_config" in case[0]])
def test_weight_format_matches_vllms_quantization_config(name, vllm_says):
    config = CASES[name][0]
    facts = vllm_says[name]["quant"]
    assert "error" not in facts, facts["error"]
    fmt = weight_format(config)
    assert fmt.method in facts["method"]  # vLLM names its readers auto_awq, auto_gptq
    if "weight_bits" in facts:
        assert fmt.bits == facts["weight_bits"]
    if facts.get("group_size") not in (None, -1) and fmt.scale == "group":
        assert fmt.group_size == facts["group_size"]
    if facts.get("weight_block_size"):
        assert list(fmt.block) == facts["weight_block_size"]
    if facts.get("load_in_4bit"):
        assert fmt.bits == 4
    for ignored in facts.get("ignore", []):
        assert not fmt.quantizes(ignored)


def test_bitsandbytes_is_refused_by_the_planner_as_vllm_refuses_it(vllm_says):
    seen = vllm_says[BNB_CASE]
    assert "bitsandbytes" in seen["error"] and "error" in seen["quant"]  # vLLM 0.32 has no such method
    with pytest.raises(QuantizationError, match="vLLM 0.32 does not load"):
        weight_format({**LLAMA31_8B, "quantization_config": BNB_4BIT})
