"""What vLLM itself says about a model's per-rank KV cache, run in a subprocess with vLLM installed.

Reads a JSON list of cases on stdin ({"name", "config", "tp", "pp", "dp", "kv_cache_dtype",
"block_size"}), writes each config.json to a folder of its own, builds vLLM's ModelConfig and
ParallelConfig from it (no GPU, no weights, no tokenizer) and answers, per case and pipeline
rank: the layers vLLM gives the rank, the KV heads and head size it caches, and the page bytes
of vLLM's own KV-cache spec for one block; also the sliding window of every layer as vLLM's
config sees it, the quantization vLLM resolves, and the parameters of the Transformers model
built on the meta device. Prints one JSON list on stdout.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def probe(case: dict, folder: Path) -> dict:
    import torch
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    path = folder / case["name"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(case["config"]))
    model = ModelConfig(
        model=str(path),
        tokenizer=str(path),
        skip_tokenizer_init=True,
        dtype=case.get("dtype", "auto"),
        max_model_len=case.get("max_model_len", 4096),
        trust_remote_code=False,
    )
    out: dict = {"name": case["name"], "use_mla": model.use_mla, "ranks": []}
    kv_dtype = case.get("kv_cache_dtype", "auto")
    torch_dtype = kv_cache_dtype_str_to_dtype(kv_dtype, model)
    for pp_rank in range(case.get("pp", 1)):
        parallel = ParallelConfig(
            tensor_parallel_size=case.get("tp", 1),
            pipeline_parallel_size=case.get("pp", 1),
            data_parallel_size=case.get("dp", 1),
            enable_expert_parallel=case.get("ep", False),
        )
        parallel.rank = pp_rank * parallel.tensor_parallel_size  # the first TP rank of this stage
        start, end = model.get_layers_start_end_indices(parallel)
        heads = model.get_num_kv_heads(parallel)
        common = dict(block_size=case.get("block_size", 16), num_kv_heads=heads, head_size=model.get_head_size())
        if model.use_mla:
            spec = MLAAttentionSpec(
                **common,
                dtype=torch_dtype,
                cache_dtype_str=kv_dtype,
                state_content_bytes={"fp8_ds_mla": 656}.get(kv_dtype),
            )
        else:
            spec = FullAttentionSpec(**common, dtype=torch_dtype)
        out["ranks"].append(
            {
                "layers": [start, end],
                "kv_heads": heads,
                "head_size": model.get_head_size(),
                "attention_layers": model.get_num_layers_by_block_type(parallel, "attention"),
                "page_size_bytes": spec.page_size_bytes,
            }
        )
    text = model.hf_text_config
    window = model.get_sliding_window()
    types = getattr(text, "layer_types", None)
    if window and types:
        sliding = [kind == "sliding_attention" for kind in types]
    elif window and getattr(text, "use_sliding_window", True) is not False:
        sliding = [True] * model.get_total_num_hidden_layers()
    else:
        sliding = [False] * model.get_total_num_hidden_layers()
    out["sliding_window"] = window if any(sliding) else None
    out["sliding"] = sliding
    out["quantization"] = model.quantization
    out["dtype"] = str(model.dtype).removeprefix("torch.")
    if case.get("count_parameters"):
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(hf)
        out["parameters"] = sum(p.numel() for p in built.parameters())
    return out


def quant_facts(case: dict) -> dict:
    """The weight format vLLM's own quantization config class reads from `quantization_config`."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    quant = case["config"]["quantization_config"]
    method = quant.get("quant_method") or "bitsandbytes"
    config = get_quantization_config(method).from_config(quant)
    facts: dict = {"method": config.get_name()}
    for attr in ("weight_bits", "group_size", "desc_act", "weight_block_size", "load_in_4bit", "load_in_8bit"):
        if hasattr(config, attr):
            value = getattr(config, attr)
            facts[attr] = list(value) if isinstance(value, tuple) else value
    schemes = getattr(config, "target_scheme_map", None)
    if schemes:
        weights = next(iter(schemes.values()))["weights"]
        facts["weight_bits"] = weights.num_bits
        facts["strategy"] = str(weights.strategy.value if hasattr(weights.strategy, "value") else weights.strategy)
        facts["group_size"] = weights.group_size
        facts["ignore"] = list(getattr(config, "ignore", []) or [])
    return facts


def main() -> None:
    cases = json.load(sys.stdin)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            try:
                result = probe(case, Path(folder))
            except Exception as exc:  # noqa: BLE001 - reported per case, the test names it
                result = {"name": case["name"], "error": f"{type(exc).__name__}: {exc}"}
            if "quantization_config" in case["config"]:
                try:
                    result["quant"] = quant_facts(case)
                except Exception as exc:  # noqa: BLE001
                    result["quant"] = {"error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
