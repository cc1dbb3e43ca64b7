"""What one token costs in a model's KV cache, whole and on one rank, from its config.json.

Bytes per token of a paged KV cache are 2 (K and V) x layers x KV heads x head_dim x dtype
bytes. Grouped-query attention caches only `num_key_value_heads`, not every attention head;
multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent of
`kv_lora_rank + qk_rope_head_dim` per layer instead of K and V; sliding-window layers hold at
most the window. vLLM hands out memory in blocks of `block-size` tokens, so capacity is whole
blocks. One rank (`rank_layout`) holds its pipeline stage's layers and `max(1, kv_heads // tp)`
KV heads (MLA: the whole latent on every rank). Pure functions; server.engine.planner uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.engine.parallel import Layout, kv_heads_per_rank, stage_layers
from server.engine.profiles import FP8_KV_CACHE_DTYPES

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp16": 2, "bf16": 2}
# vLLM's DeepSeek fp8 MLA cache: the 512 latent dims in fp8, the 64 rope dims in 16-bit, scales.
FP8_DS_MLA_BYTES_PER_LAYER = 656
# Every n-th layer global, the rest sliding, for configs that list no `layer_types` (their
# Transformers config classes fill it in so): Gemma-2 alternates, Gemma-3 keeps one in six.
DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


class PlanError(ValueError):
    """The plan cannot be made (no config.json, no memory figure, a layout vLLM refuses), with the reason."""


@dataclass(frozen=True)
class KvLayout:
    """What one token costs in the KV cache: of the whole model, or of one rank (`rank_layout`)."""

    attention: str  # "mha", "gqa", "mqa" or "mla"
    layers: int
    kv_heads: int  # 0 for MLA
    head_dim: int  # per cached vector: head_dim, or kv_lora_rank + qk_rope_head_dim for MLA
    dtype_bytes: int
    bytes_per_token: int  # every layer counted as full attention
    full_attention_layers: int
    sliding_window_layers: int
    sliding_window: int | None
    textbook_bytes_per_token: int  # 2 x layers x num_attention_heads x head_dim x bytes
    layer_bytes_per_token: int = 0  # one layer's bytes of one token
    sliding: tuple[bool, ...] = ()  # per layer: does it slide


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config.json."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def model_dtype(config: dict[str, Any]) -> str:
    """The dtype vLLM runs a checkpoint in with `dtype: auto`: its config's, but a float32
    checkpoint (Gemma-2's) is run in bfloat16, as vLLM downcasts it."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return "bfloat16" if name in ("float32", "float") else name


def dtype_bytes(kv_cache_dtype: str, model_dtype_name: str) -> int:
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return 1
    name = model_dtype_name if kv_cache_dtype == "auto" else kv_cache_dtype
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r} for the KV cache") from None


def kv_layout(config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str | None = None) -> KvLayout:
    """The KV-cache cost per token of a whole model, from its config.json mapping."""
    cfg = text_config(config)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise PlanError(f"config.json has no {exc.args[0]!r}") from None
    nbytes = dtype_bytes(kv_cache_dtype, dtype or model_dtype(cfg))
    default_head_dim = int(cfg["hidden_size"]) // heads if "hidden_size" in cfg else 0
    head_dim = int(cfg.get("head_dim") or default_head_dim)

    if cfg.get("kv_lora_rank"):  # multi-head latent attention: one latent per token and layer
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        k_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
        v_dim = int(cfg.get("v_head_dim") or k_dim)
        per_layer = FP8_DS_MLA_BYTES_PER_LAYER if kv_cache_dtype == "fp8_ds_mla" else latent * nbytes
        return KvLayout(
            attention="mla",
            layers=layers,
            kv_heads=0,
            head_dim=latent,
            dtype_bytes=nbytes,
            bytes_per_token=layers * per_layer,
            full_attention_layers=layers,
            sliding_window_layers=0,
            sliding_window=None,
            textbook_bytes_per_token=layers * heads * (k_dim + v_dim) * nbytes,
            layer_bytes_per_token=per_layer,
            sliding=(False,) * layers,
        )

    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    attention = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    window, flags = sliding_flags(cfg, layers)
    sliding = sum(flags)
    return KvLayout(
        attention=attention,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=nbytes,
        bytes_per_token=2 * layers * kv_heads * head_dim * nbytes,
        full_attention_layers=layers - sliding,
        sliding_window_layers=sliding,
        sliding_window=window,
        textbook_bytes_per_token=2 * layers * heads * head_dim * nbytes,
        layer_bytes_per_token=2 * kv_heads * head_dim * nbytes,
        sliding=flags,
    )


def sliding_flags(cfg: dict[str, Any], layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """(window, per layer: does it slide). Newer configs list `layer_types`; Gemma-3 makes every
    `sliding_window_pattern`-th layer global; Mistral-style configs slide on every layer;
    Qwen2-style configs only when `use_sliding_window`."""
    window = cfg.get("sliding_window")
    none = (False,) * layers
    if not window or cfg.get("use_sliding_window") is False:
        return None, none
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise PlanError(f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
        flags = tuple("sliding" in str(kind) for kind in types)
        return (int(window), flags) if any(flags) else (None, none)
    pattern = cfg.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN.get(str(cfg.get("model_type")))
    if isinstance(pattern, int) and pattern > 1:
        return int(window), tuple((i + 1) % pattern != 0 for i in range(layers))
    return int(window), (True,) * layers


def sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, how many layers use it)."""
    window, flags = sliding_flags(cfg, layers)
    return window, sum(flags)


def sequence_bytes(layout: KvLayout, tokens: int) -> int:
    """KV bytes one sequence of `tokens` holds (sliding-window layers cap at the window)."""
    per_layer = layout.bytes_per_token // layout.layers
    windowed = min(tokens, layout.sliding_window or tokens)
    return per_layer * (layout.full_attention_layers * tokens + layout.sliding_window_layers * windowed)


def blocks_per_sequence(layout: KvLayout, block_size: int, tokens: int) -> int:
    """Paged blocks one sequence of `tokens` needs."""
    return math.ceil(sequence_bytes(layout, tokens) / (layout.bytes_per_token * block_size))


def capacity(layout: KvLayout, kv_memory: int, block_size: int, max_model_len: int) -> tuple[int, int, int]:
    """(blocks, tokens, sequences at max_model_len) that `kv_memory` bytes hold."""
    bytes_per_block = layout.bytes_per_token * block_size
    blocks = kv_memory // bytes_per_block if kv_memory > 0 else 0
    per_seq = blocks_per_sequence(layout, block_size, max_model_len)
    return blocks, blocks * block_size, blocks // per_seq if per_seq else 0


def rank_layout(layout: KvLayout, parallel: Layout, stage: int) -> KvLayout:
    """The KV layout one GPU of pipeline stage `stage` holds: its layers, its KV heads."""
    start, end = stage_layers(layout.layers, parallel.pp)[stage]
    flags = layout.sliding[start:end] if layout.sliding else (False,) * (end - start)
    heads = kv_heads_per_rank(layout.kv_heads, parallel.tp, mla=layout.attention == "mla")
    mla = layout.attention == "mla"
    per_layer = layout.layer_bytes_per_token if mla else 2 * heads * layout.head_dim * layout.dtype_bytes
    sliding = sum(flags)
    return KvLayout(
        attention=layout.attention,
        layers=end - start,
        kv_heads=heads if layout.attention != "mla" else 0,
        head_dim=layout.head_dim,
        dtype_bytes=layout.dtype_bytes,
        bytes_per_token=(end - start) * per_layer,
        full_attention_layers=end - start - sliding,
        sliding_window_layers=sliding,
        sliding_window=layout.sliding_window if sliding else None,
        textbook_bytes_per_token=layout.textbook_bytes_per_token,
        layer_bytes_per_token=per_layer,
        sliding=flags,
    )
