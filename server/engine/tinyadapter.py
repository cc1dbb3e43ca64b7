"""A tiny LoRA adapter for the project's tiny model, built offline (no peft, no download).

A PEFT LoRA adapter is two files: `adapter_config.json` (rank, alpha, target modules) and
`adapter_model.safetensors` (an `A` and a `B` matrix per target module). This writes both for
the tiny Llama (server.engine.tinymodel): rank 8 on every layer's `q_proj` and `v_proj`, with
seeded random weights large enough that the adapter visibly changes the model's (gibberish)
output. vLLM loads it with `--enable-lora --lora-modules NAME=PATH`, or at run time through
`/v1/load_lora_adapter`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from server.engine.tinymodel import MODEL_SHAPE

RANK = 8
ALPHA = 16
SEED = 4321
TARGETS = ("q_proj", "v_proj")


def _shapes() -> dict[str, tuple[int, int]]:
    """(out, in) features of each target projection of the tiny model."""
    hidden = MODEL_SHAPE["hidden_size"]
    head_dim = hidden // MODEL_SHAPE["num_attention_heads"]
    return {"q_proj": (hidden, hidden), "v_proj": (MODEL_SHAPE["num_key_value_heads"] * head_dim, hidden)}


def adapter_config(base_model: str) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def is_built(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / "adapter_config.json").exists() and (directory / "adapter_model.safetensors").exists()


def build_tiny_adapter(
    directory: str | Path, *, base_model: str = "tiny", force: bool = False, log: Callable[[str], object] = print
) -> Path:
    """Write the adapter to `directory` (skipped when one is there); the same bytes every time."""
    directory = Path(directory)
    if is_built(directory) and not force:
        log(f"tiny LoRA adapter already at {directory}")
        return directory
    rng = np.random.default_rng(SEED)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(MODEL_SHAPE["num_hidden_layers"])):
        for module, (out_features, in_features) in _shapes().items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.5, (RANK, in_features)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.5, (out_features, RANK)).astype(np.float32)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    (staging / "adapter_config.json").write_text(json.dumps(adapter_config(base_model), indent=2) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    log(f"tiny LoRA adapter written to {directory}")
    return directory
