"""The planner rank by rank, and the weight formats, against values computed by hand."""

from __future__ import annotations

import json
import math

import pytest

from server.cli import main as cli_main
from server.engine.kv import kv_layout, rank_layout
from server.engine.parallel import Layout, kv_heads_per_rank, padded_vocab_rows, stage_layers
from server.engine.planner import GPU_OVERHEAD_BYTES, PlanError, parse_size, plan_profile, rank_weight_bytes
from server.engine.profiles import ProfileError, load_profile, profiles_dir
from server.engine.quantization import QuantizationError, weight_format

GiB = 2**30
MODELS = profiles_dir().parent / "models"


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


DEEPSEEK = config("deepseek-ai--DeepSeek-V3")
LLAMA70 = config("meta-llama--Meta-Llama-3-70B-Instruct")
LLAMA8 = config("meta-llama--Llama-3.1-8B-Instruct")


def profile(tmp_path, body: str, name: str = "p"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return load_profile(path)


# -- KV heads, layers, bytes per rank ---------------------------------------------------------------


def test_kv_heads_are_divided_but_never_below_one():
    assert [kv_heads_per_rank(8, tp, mla=False) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    assert kv_heads_per_rank(128, 8, mla=True) == 1


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_them():
    whole = kv_layout(LLAMA70)  # 80 layers x 8 KV heads x 128 x bf16
    rank = rank_layout(whole, Layout(tp=16), 0)
    assert rank.kv_heads == 1
    assert rank.bytes_per_token == 2 * 80 * 1 * 128 * 2 == 40_960
    assert 16 * rank.bytes_per_token == 2 * whole.bytes_per_token  # two copies of every head


def test_mla_holds_the_whole_latent_on_every_rank():
    whole = kv_layout(DEEPSEEK, "fp8")
    rank = rank_layout(whole, Layout(tp=8), 0)
    assert rank.bytes_per_token == whole.bytes_per_token == 61 * 576 == 35_136


def test_fp8_ds_mla_is_656_bytes_a_layer():
    assert kv_layout(DEEPSEEK, "fp8_ds_mla").bytes_per_token == 61 * 656


def test_pipeline_stages_split_layers_as_vllm():
    assert stage_layers(61, 2) == [(0, 31), (31, 61)]
    assert stage_layers(80, 3) == [(0, 27), (27, 54), (54, 80)]
    assert stage_layers(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]
    with pytest.raises(ValueError, match="more than the model's 61 layers"):
        stage_layers(61, 62)


def test_vocabulary_rows_are_padded_to_64_then_split():
    assert padded_vocab_rows(129280, 8) == 129280 // 8
    assert padded_vocab_rows(32001, 1) == 32064
    assert padded_vocab_rows(32001, 2) == 16032


# -- weights per rank -------------------------------------------------------------------------------


def test_tensor_parallel_splits_weights_and_replicates_what_vllm_replicates():
    one = rank_weight_bytes(LLAMA8, Layout(), 0)
    two = rank_weight_bytes(LLAMA8, Layout(tp=2), 0)
    norms = (2 * 32 + 1) * 4096 * 2  # norms stay whole on every rank
    assert two == pytest.approx((one - norms) / 2 + norms, abs=1)


def test_experts_are_split_over_tp_x_dp_and_attention_over_tp_only():
    tp8 = rank_weight_bytes(DEEPSEEK, Layout(tp=8), 0)
    dp8 = rank_weight_bytes(DEEPSEEK, Layout(dp=8, ep=True), 0)
    dp8_sliced = rank_weight_bytes(DEEPSEEK, Layout(dp=8), 0)  # no EP: every expert in 8 slices
    assert dp8 == pytest.approx(dp8_sliced, rel=0.001)  # 256 experts divide by 8 either way
    # DP keeps attention, dense MLPs, shared experts and embeddings whole on each rank: more a GPU.
    assert dp8 - tp8 == pytest.approx(14.6 * GiB, rel=0.05)
    # Expert parallel over 3 ranks: the busiest holds ceil(256 / 3) = 86 experts.
    ep3 = rank_weight_bytes(DEEPSEEK, Layout(dp=3, ep=True), 0)
    ep4 = rank_weight_bytes(DEEPSEEK, Layout(dp=4, ep=True), 0)
    expert = 3 * (2048 * 7168 + math.ceil(2048 / 128) * math.ceil(7168 / 128) * 4)  # fp8 + block scales
    assert ep3 - ep4 == 58 * (86 - 64) * expert


def test_pipeline_stages_hold_their_own_layers_the_first_the_embedding_the_last_the_head():
    first, last = (rank_weight_bytes(LLAMA70, Layout(pp=2), stage) for stage in (0, 1))
    whole = rank_weight_bytes(LLAMA70, Layout(), 0)
    assert first + last == whole  # untied: nothing held twice
    embedding = 128256 * 8192 * 2
    assert first - last == pytest.approx(0, abs=embedding * 0.01)  # 40 layers + embedding vs 40 + head


# -- weight formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "expected"),
    [
        # fp8, 128x128 blocks: 1 byte a value, an fp32 scale a block
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 256 * 384 + 2 * 3 * 4),
        ({"quant_method": "fp8"}, 256 * 384 + 4),  # per-tensor scale
        # AWQ 4-bit, groups of 128: half a byte a value; fp16 scale and a 4-bit zero per group and row
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, 256 * 384 // 2 + 256 * 3 * 2 + 256 * 3 // 2),
        # GPTQ 8-bit with act-order: + an int32 g_idx per input
        (
            {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": True},
            256 * 384 + 256 * 3 * 2 + 256 * 3 + 384 * 4,
        ),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, 256 * 384 // 2 + 256 * 2 + 256 // 2),
        # compressed-tensors w4a16, groups of 128, symmetric: no zero points
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}}
                },
            },
            256 * 384 // 2 + 256 * 3 * 2,
        ),
        # NVFP4: 4-bit floats, an fp8 scale per 16
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                    }
                },
            },
            256 * 384 // 2 + 256 * 24,
        ),
        # fp8 per channel: a bf16 scale a row
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
                },
            },
            256 * 384 + 256 * 2,
        ),
    ],
)
def test_linear_bytes_of_each_format(quant, expected):
    fmt = weight_format({"quantization_config": quant})
    assert fmt.linear_bytes(256, 384, 2) == expected
    assert fmt.linear_bytes(256, 384, 2, quantized=False) == 256 * 384 * 2


def test_skip_lists_and_what_stays_unquantized():
    awq = weight_format({"quantization_config": {"quant_method": "awq", "modules_to_not_convert": ["self_attn"]}})
    assert not awq.quantizes("model.layers.3.self_attn.q_proj") and awq.quantizes("model.layers.3.mlp.up_proj")
    assert not awq.quantizes("lm_head")  # the head stays at the model's dtype
    ct = weight_format(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "ignore": ["lm_head", "re:.*mlp.gate$"],
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}}},
            }
        }
    )
    assert not ct.quantizes("lm_head") and not ct.quantizes("model.layers.0.mlp.gate")
    assert ct.quantizes("model.layers.0.mlp.gate_proj")
    mxfp4 = weight_format({"quantization_config": {"quant_method": "mxfp4"}})
    assert mxfp4.quantizes("model.layers.0.mlp.experts.0.up_proj", expert=True)
    assert not mxfp4.quantizes("model.layers.0.self_attn.q_proj")  # MXFP4 quantizes experts only
    assert mxfp4.linear_bytes(32, 64, 2) == 32 * 64 // 2 + 32 * 2  # 4 bits + an e8m0 byte per 32


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "hqq"}, "'hqq' is not one the planner knows"),
        ({"quant_method": "awq", "bits": 3}, "vLLM loads 4-bit AWQ"),
        ({"quant_method": "gptq", "bits": "4"}, "expected an integer"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "expected [rows, cols]"),
        ({"quant_method": "compressed-tensors"}, "config_groups"),
        ({"load_in_4bit": True}, "vLLM 0.32 does not load"),
        ("fp8", "expected a mapping"),
    ],
)
def test_formats_that_cannot_be_planned_say_why(quant, message):
    with pytest.raises(QuantizationError) as refused:
        weight_format({"quantization_config": quant})
    assert message in str(refused.value)


# -- plans ------------------------------------------------------------------------------------------


def test_the_deepseek_profiles_fit_and_dp_holds_more_than_tp():
    dp = plan_profile(load_profile(profiles_dir() / "deepseek-v3.yaml"), parse_size("141GiB"))
    tp = plan_profile(load_profile(profiles_dir() / "deepseek-v3-tp8.yaml"), parse_size("141GiB"))
    two = plan_profile(load_profile(profiles_dir() / "deepseek-v3-two-nodes.yaml"), parse_size("80GiB"))
    for plan in (dp, tp, two):
        assert plan.max_concurrent_sequences >= 1 and plan.weight_format == "fp8"
        (rank,) = plan.ranks
        assert rank.kv_heads == 1 and rank.kv_bytes_per_token == 35_136
        usable = (141 if plan is not two else 80) * GiB * 0.9
        assert rank.kv_memory_bytes == int(usable - rank.weights_bytes - GPU_OVERHEAD_BYTES)
        assert rank.num_blocks == rank.kv_memory_bytes // (35_136 * 64)
        assert plan.kv_cache_tokens == plan.data_parallel_size * rank.num_blocks * 64
        assert plan.max_concurrent_sequences == plan.data_parallel_size * (rank.num_blocks // 128)
    assert (dp.gpus, tp.gpus, two.gpus) == (8, 8, 16)
    assert tp.kv_bytes_per_token_all_ranks == 8 * 35_136  # one token, 8 copies
    assert dp.kv_cache_tokens > 4 * tp.kv_cache_tokens
    assert two.max_concurrent_sequences_per_dp_rank * 16 == two.max_concurrent_sequences


def test_a_plan_that_does_not_fit_names_the_smallest_layouts_that_would(tmp_path, capsys):
    unquantized = {k: v for k, v in DEEPSEEK.items() if k != "quantization_config"}
    (tmp_path / "ds.json").write_text(json.dumps(unquantized))
    body = (
        "model: deepseek-ai/DeepSeek-V3\nserved_model_name: ds\nplanner:\n  model_config_path: ds.json\n"
        "vllm:\n  max-model-len: 8192\n  tensor-parallel-size: 8\n  block-size: 64\n"
    )
    plan = plan_profile(profile(tmp_path, body), parse_size("80GiB"))
    assert plan.max_concurrent_sequences == 0 and plan.weight_format == "none"
    kinds = {(f["tp"] > 1, f["pp"] > 1, f["dp"] > 1): f for f in plan.fitting_layouts}
    assert set(kinds) == {(True, False, False), (True, True, False), (False, False, True)}

    def holds(flags: dict) -> int:
        lines = "".join(f"  {k}: {str(v).lower()}\n" for k, v in flags.items())
        return plan_profile(
            profile(tmp_path, body.replace("  tensor-parallel-size: 8\n", lines), name="x"), memory
        ).max_concurrent_sequences

    memory = parse_size("80GiB")
    for found in plan.fitting_layouts:  # each holds a sequence
        assert holds(found["flags"]) >= 1
    tp_only, dp_ep = kinds[(True, False, False)], kinds[(False, False, True)]
    assert holds({"tensor-parallel-size": tp_only["tp"] // 2}) == 0  # and half of it does not
    assert (
        holds({"tensor-parallel-size": 1, "data-parallel-size": dp_ep["dp"] // 2, "enable-expert-parallel": True}) == 0
    )
    assert tp_only["gpus"] == 32 and dp_ep["gpus"] == 32  # 1.25 TiB of bf16 weights on 80 GiB GPUs
    assert cli_main(["plan", str(tmp_path / "p.yaml"), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "would fit       TP=" in out and "+ EP" in out and "--enable-expert-parallel" in out


def test_plan_json_keeps_its_keys_and_adds_the_ranks(capsys):
    assert cli_main(["plan", "deepseek-v3-two-nodes", "--device-memory", "80GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"kv_cache_tokens", "weights_bytes", "max_concurrent_sequences"} <= data.keys()
    assert data["data_parallel_size"] == 16 and data["expert_parallel"] is True
    (rank,) = data["ranks"]
    assert {"layers", "kv_heads", "kv_bytes_per_token", "weights_bytes", "kv_memory_bytes", "num_blocks"} <= rank.keys()


def test_layouts_vllm_refuses_are_refused_with_the_reason(tmp_path):
    body = "model: meta-llama/Meta-Llama-3-70B-Instruct\nserved_model_name: m\nvllm:\n  tensor-parallel-size: {tp}\n"
    with pytest.raises(PlanError, match="64 attention heads do not divide by tensor-parallel-size 3"):
        plan_profile(profile(tmp_path, body.format(tp=3)), parse_size("80GiB"))
    ep = "model: meta-llama/Meta-Llama-3-70B-Instruct\nserved_model_name: m\nvllm:\n  enable-expert-parallel: true\n"
    with pytest.raises(PlanError, match="expert-parallel on a model without experts"):
        plan_profile(profile(tmp_path, ep), parse_size("80GiB"))
    with pytest.raises(ProfileError, match="data-parallel-size-local: 3 does not divide data-parallel-size 8"):
        profile(
            tmp_path,
            "model: o/m\nserved_model_name: m\nvllm:\n  data-parallel-size: 8\n  data-parallel-size-local: 3\n",
        )
    with pytest.raises(ProfileError, match="data-parallel-size: expected a positive integer"):
        profile(tmp_path, "model: o/m\nserved_model_name: m\nvllm:\n  data-parallel-size: 0\n")
