"""What one weight matrix costs on the GPU under a checkpoint's `quantization_config`.

vLLM reads `quantization_config` from config.json and loads each linear layer in that format;
embeddings, norms and the modules a format leaves out stay at the model's dtype. The bytes of a
quantized (out x in) matrix are its packed values plus the scales (and zero points) the format
keeps per tensor, channel, group or block:

    fp8                 1 byte a value; fp32 scale per 128x128 block (`weight_block_size`) or per tensor
    awq                 `w_bit`-bit values; fp16 scale and packed zero point per `q_group_size` inputs
    gptq                `bits`-bit values; fp16 scale and packed zero per `group_size` inputs
                        (-1: per output channel); int32 `g_idx` per input with `desc_act`
    compressed-tensors  `num_bits` per value as its config group says; scales per tensor,
                        channel, group or block (bf16, fp8 for 4-bit float groups of 16: NVFP4)
    mxfp4               MoE experts only: 4-bit e2m1 + one e8m0 byte per 32 values

Modules are matched against the format's skip lists (`modules_to_not_convert`,
`ignored_layers`, `ignore` with `re:` patterns) by their dotted names. bitsandbytes checkpoints
are refused with the reason: vLLM 0.32 has no loader for them (the cross-check test asserts that
vLLM still refuses them, so a vLLM that loads them again shows up there).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

KNOWN_METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "mxfp4")


class QuantizationError(ValueError):
    """A `quantization_config` the planner cannot read, with the reason."""


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores its linear layers (`method` "none": at the model's dtype)."""

    method: str
    bits: int = 16
    # Scales: "none", "tensor", "channel" (per output row), "group" (per `group_size` inputs
    # of a row) or "block" (per `block` of out x in).
    scale: str = "none"
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    scale_bytes: float = 0.0
    zero_bits: int = 0  # packed zero points per scale (AWQ, GPTQ)
    input_index_bytes: int = 0  # GPTQ act-order: g_idx per input
    experts_only: bool = False  # MXFP4: dense linear layers stay unquantized
    skip: tuple[str, ...] = field(default_factory=tuple)
    lm_head: bool = False  # the output head is quantized too

    def quantizes(self, module: str, *, expert: bool = False) -> bool:
        """Whether the linear layer named `module` (dotted path) is stored in this format."""
        if self.method == "none":
            return False
        if self.experts_only and not expert:
            return False
        if module == "lm_head" and not self.lm_head:
            return False
        return not any(_matches(pattern, module) for pattern in self.skip)

    def linear_bytes(self, out_features: int, in_features: int, dtype_bytes: int, *, quantized: bool = True) -> int:
        """Bytes of one (out x in) weight matrix: values plus scales, zeros and indices."""
        if not quantized or self.method == "none":
            return out_features * in_features * dtype_bytes
        values = math.ceil(out_features * in_features * self.bits / 8)
        if self.scale == "tensor":
            scales = 1
        elif self.scale == "channel":
            scales = out_features
        elif self.scale == "group":
            scales = out_features * math.ceil(in_features / self.group_size)
        elif self.scale == "block":
            scales = math.ceil(out_features / self.block[0]) * math.ceil(in_features / self.block[1])
        else:
            scales = 0
        extra = math.ceil(scales * self.scale_bytes) + math.ceil(scales * self.zero_bits / 8)
        return values + extra + self.input_index_bytes * in_features


NONE = WeightFormat(method="none")


def _matches(pattern: str, module: str) -> bool:
    """A skip-list entry against a dotted module name: `re:` regex, `*` glob, or whole dotted segments."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], module) is not None
    if "*" in pattern:
        return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    return f".{pattern}." in f".{module}."


def weight_format(config: dict[str, Any]) -> WeightFormat:
    """The weight format of a config.json (its `quantization_config`, or the dtype's when absent)."""
    quant = config.get("quantization_config")
    if quant is None:
        inner = config.get("text_config")
        quant = inner.get("quantization_config") if isinstance(inner, dict) else None
    if quant is None:
        return NONE
    if not isinstance(quant, dict):
        raise QuantizationError(f"quantization_config: expected a mapping, got {quant!r}")
    method = str(quant.get("quant_method") or "").lower().replace("_", "-")
    if method == "bitsandbytes" or (not method and ("load_in_4bit" in quant or "load_in_8bit" in quant)):
        raise QuantizationError(
            "quantization_config: a bitsandbytes checkpoint, which vLLM 0.32 does not load (bitsandbytes is not "
            "among its quantization methods); serve an AWQ, GPTQ or compressed-tensors build of the model"
        )
    readers = {"fp8": _fp8, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "mxfp4": _mxfp4}
    if method not in readers:
        raise QuantizationError(
            f"quantization_config.quant_method {quant.get('quant_method')!r} is not one the planner knows "
            f"({', '.join(KNOWN_METHODS)}); give the weights' bytes with planner.weights_bytes"
        )
    return readers[method](quant)


def _skip_list(quant: dict[str, Any], *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        value = quant.get(key)
        if isinstance(value, list):
            out += [str(item) for item in value]
    return tuple(out)


def _positive(quant: dict[str, Any], key: str, default: int, method: str) -> int:
    value = quant.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantizationError(f"quantization_config.{key} ({method}): expected an integer, got {value!r}")
    return value


def _fp8(quant: dict[str, Any]) -> WeightFormat:
    block = quant.get("weight_block_size")
    skip = _skip_list(quant, "modules_to_not_convert", "ignored_layers")
    if block is None:
        return WeightFormat(method="fp8", bits=8, scale="tensor", scale_bytes=4, skip=skip)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"quantization_config.weight_block_size (fp8): expected [rows, cols], got {block!r}")
    return WeightFormat(method="fp8", bits=8, scale="block", block=(block[0], block[1]), scale_bytes=4, skip=skip)


def _awq(quant: dict[str, Any]) -> WeightFormat:
    bits = _positive(quant, "w_bit" if "w_bit" in quant else "bits", 4, "awq")
    group = _positive(quant, "q_group_size" if "q_group_size" in quant else "group_size", 128, "awq")
    if bits != 4:
        raise QuantizationError(f"quantization_config.bits (awq): vLLM loads 4-bit AWQ, got {bits}")
    return WeightFormat(
        method="awq",
        bits=bits,
        scale="group" if group > 0 else "channel",
        group_size=group,
        scale_bytes=2,
        zero_bits=bits,
        skip=_skip_list(quant, "modules_to_not_convert"),
    )


def _gptq(quant: dict[str, Any]) -> WeightFormat:
    bits = _positive(quant, "bits", 4, "gptq")
    if bits not in (2, 3, 4, 8):
        raise QuantizationError(f"quantization_config.bits (gptq): expected 2, 3, 4 or 8, got {bits}")
    group = _positive(quant, "group_size", 128, "gptq")
    return WeightFormat(
        method="gptq",
        bits=bits,
        scale="group" if group > 0 else "channel",
        group_size=group,
        scale_bytes=2,
        zero_bits=bits,
        input_index_bytes=4 if quant.get("desc_act") else 0,
        skip=_skip_list(quant, "modules_to_not_convert", "modules_in_block_to_quantize_skip"),
        lm_head=bool(quant.get("lm_head")),
    )


def _compressed_tensors(quant: dict[str, Any]) -> WeightFormat:
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("quantization_config.config_groups (compressed-tensors): expected a non-empty mapping")
    weights = []
    for name, group in groups.items():
        spec = group.get("weights") if isinstance(group, dict) else None
        if isinstance(spec, dict):
            weights.append((name, group, spec))
    if not weights:
        return WeightFormat(method="compressed-tensors", skip=_skip_list(quant, "ignore"))  # activations only
    name, group, spec = weights[0]
    if len({(s.get("num_bits"), s.get("strategy"), s.get("group_size")) for _, _, s in weights}) > 1:
        raise QuantizationError(
            "quantization_config.config_groups (compressed-tensors): groups of different weight formats "
            "are not planned; give the weights' bytes with planner.weights_bytes"
        )
    bits = _positive(spec, "num_bits", 8, "compressed-tensors")
    strategy = str(spec.get("strategy") or "tensor")
    targets = group.get("targets") or ["Linear"]
    if not any(str(t) == "Linear" or str(t).startswith("re:") for t in targets):
        raise QuantizationError(f"config_groups.{name}.targets (compressed-tensors): expected Linear, got {targets!r}")
    is_float = spec.get("type") == "float"
    scale_bytes = 1.0 if (is_float and bits == 4) else 2.0  # NVFP4 keeps fp8 scales per group of 16
    common: dict[str, Any] = {
        "method": "compressed-tensors",
        "bits": bits,
        "scale_bytes": scale_bytes,
        "zero_bits": bits if spec.get("symmetric") is False else 0,
        "skip": _skip_list(quant, "ignore"),
        "lm_head": True,  # targets every Linear unless `ignore` names it (checkpoints do)
    }
    if strategy in ("group", "tensor_group"):
        group_size = _positive(spec, "group_size", 128, "compressed-tensors")
        return WeightFormat(scale="group", group_size=group_size, **common)
    if strategy == "block":
        block = spec.get("block_structure") or [128, 128]
        return WeightFormat(scale="block", block=(int(block[0]), int(block[1])), **common)
    if strategy in ("channel", "tensor"):
        return WeightFormat(scale=strategy, **common)
    raise QuantizationError(f"config_groups.{name}.weights.strategy (compressed-tensors): unknown {strategy!r}")


def _mxfp4(quant: dict[str, Any]) -> WeightFormat:
    return WeightFormat(
        method="mxfp4",
        bits=4,
        scale="group",
        group_size=32,
        scale_bytes=1,
        experts_only=True,
        skip=_skip_list(quant, "modules_to_not_convert"),
    )
