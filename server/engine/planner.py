"""KV-cache arithmetic for a profile, from the model's own config.json.

Bytes per token of a paged KV cache are 2 (K and V) x layers x KV heads x head_dim x dtype
bytes. Grouped-query attention caches only `num_key_value_heads`, not every attention head;
multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent of
`kv_lora_rank + qk_rope_head_dim` per layer instead of K and V; sliding-window layers hold at
most the window. vLLM hands out memory in blocks of `block-size` tokens, so capacity is whole
blocks. The pure functions here are what the tests check against hand-computed values; `plan`
ties them to a profile and the memory it gets.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.engine.profiles import FP8_KV_CACHE_DTYPES, Profile, load_profile, resolve_profile_path

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp16": 2, "bf16": 2}
# What vLLM itself keeps out of the KV budget on a GPU besides weights (activations of the
# profiling run, CUDA graphs, the non-torch allocator): an assumption, stated in the output.
GPU_OVERHEAD_BYTES = int(1.5 * GiB)


class PlanError(ValueError):
    """The plan cannot be made (no config.json, no memory figure), with the reason."""


@dataclass(frozen=True)
class KvLayout:
    """What one token costs in the KV cache of one engine (all its GPUs together)."""

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


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config.json."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def model_dtype(config: dict[str, Any]) -> str:
    return str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")


def dtype_bytes(kv_cache_dtype: str, model_dtype_name: str) -> int:
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return 1
    name = model_dtype_name if kv_cache_dtype == "auto" else kv_cache_dtype
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r} for the KV cache") from None


def kv_layout(config: dict[str, Any], kv_cache_dtype: str = "auto", dtype: str | None = None) -> KvLayout:
    """The KV-cache cost per token of a model, from its config.json mapping."""
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
        return KvLayout(
            attention="mla",
            layers=layers,
            kv_heads=0,
            head_dim=latent,
            dtype_bytes=nbytes,
            bytes_per_token=layers * latent * nbytes,
            full_attention_layers=layers,
            sliding_window_layers=0,
            sliding_window=None,
            textbook_bytes_per_token=layers * heads * (k_dim + v_dim) * nbytes,
        )

    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    attention = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    window, sliding = sliding_layers(cfg, layers)
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
    )


def sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int | None, int]:
    """(window, how many layers use it). Newer configs list `layer_types`; Mistral-style
    configs slide on every layer; Qwen2-style configs only when `use_sliding_window`."""
    window = cfg.get("sliding_window")
    if not window:
        return None, 0
    if cfg.get("use_sliding_window") is False:
        return None, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        count = sum(1 for kind in types if "sliding" in str(kind))
        return (int(window), count) if count else (None, 0)
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:  # Gemma-3: every `pattern`-th layer is global
        return int(window), layers - layers // pattern
    return int(window), layers


def sequence_bytes(layout: KvLayout, tokens: int) -> int:
    """KV bytes one sequence of `tokens` holds (sliding-window layers cap at the window)."""
    per_layer = layout.bytes_per_token // layout.layers
    windowed = min(tokens, layout.sliding_window or tokens)
    return per_layer * (layout.full_attention_layers * tokens + layout.sliding_window_layers * windowed)


def estimate_weight_bytes(config: dict[str, Any], dtype: str | None = None) -> int:
    """Parameter bytes of a dense or MoE decoder from its config (embeddings, attention, MLP)."""
    cfg = text_config(config)
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg.get("vocab_size") or 0)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    nbytes = DTYPE_BYTES.get(dtype or model_dtype(cfg), 2)
    if cfg.get("kv_lora_rank"):
        q_rank = int(cfg.get("q_lora_rank") or 0)
        qk = int(cfg.get("qk_nope_head_dim", 128)) + int(cfg.get("qk_rope_head_dim", 64))
        v_dim = int(cfg.get("v_head_dim", 128))
        q_proj = hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
        kv_rank = int(cfg["kv_lora_rank"])
        attn = (
            q_proj
            + hidden * (kv_rank + int(cfg.get("qk_rope_head_dim", 64)))
            + kv_rank * heads * (int(cfg.get("qk_nope_head_dim", 128)) + v_dim)
            + heads * v_dim * hidden
        )
    else:
        attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        shared = int(cfg.get("n_shared_experts") or 0)
        moe_mlp = 3 * hidden * moe_inter * (experts + shared) + hidden * experts
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return (embeddings + layers * attn + mlp_total) * nbytes


def parse_size(text: str) -> int:
    """'80GiB', '24GB', '512MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise PlanError(f"cannot read the size {text!r}; write e.g. 80GiB or 24GB")
    number = float(match.group(1))
    unit = (match.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)


@dataclass(frozen=True)
class Plan:
    profile: str
    model: str
    attention: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    textbook_kv_bytes_per_token: int
    block_size: int
    bytes_per_block: int
    kv_memory_bytes: int
    kv_memory_source: str
    num_blocks: int
    kv_cache_tokens: int
    max_model_len: int
    blocks_per_sequence: int
    max_concurrent_sequences: int
    sliding_window: int | None
    sliding_window_layers: int
    weights_bytes: int | None
    # A GPU plan that holds no sequence at max-model-len: the smallest tensor-parallel size that would.
    min_tensor_parallel_size: int | None
    layers: int
    kv_heads: int
    head_dim: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def blocks_per_sequence(layout: KvLayout, block_size: int, tokens: int) -> int:
    """Paged blocks one sequence of `tokens` needs."""
    return math.ceil(sequence_bytes(layout, tokens) / (layout.bytes_per_token * block_size))


def capacity(layout: KvLayout, kv_memory: int, block_size: int, max_model_len: int) -> tuple[int, int, int]:
    """(blocks, tokens, sequences at max_model_len) that `kv_memory` bytes hold."""
    bytes_per_block = layout.bytes_per_token * block_size
    blocks = kv_memory // bytes_per_block if kv_memory > 0 else 0
    per_seq = blocks_per_sequence(layout, block_size, max_model_len)
    return blocks, blocks * block_size, blocks // per_seq if per_seq else 0


def load_model_config(profile: Profile) -> tuple[dict[str, Any], Path]:
    """config.json for a profile: in the local model folder, or a shipped copy for a hub id."""
    candidates: list[Path] = []
    if profile.planner.model_config_path:
        path = Path(profile.planner.model_config_path)
        if not path.is_absolute() and profile.source is not None:
            path = profile.source.parent / path
        candidates.append(path if path.name.endswith(".json") else path / "config.json")
    if profile.model_path is not None:
        candidates.append(profile.model_path / "config.json")
    else:
        shipped = Path(__file__).resolve().parents[2] / "configs" / "models"
        candidates.append(shipped / profile.model.replace("/", "--") / "config.json")
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()), path
    if profile.build_tiny_model and profile.model_path is not None:
        # Not built yet (the first `make run` builds it): its shape is known without building it.
        from server.engine.tinymodel import MODEL_SHAPE

        return {"model_type": "llama", "torch_dtype": "bfloat16", **MODEL_SHAPE}, profile.model_path / "config.json"
    raise PlanError(
        f"no config.json for {profile.model}: looked at "
        + ", ".join(str(c) for c in candidates)
        + (" (build the tiny model first: python -m server tiny-model)" if profile.build_tiny_model else "")
    )


def plan_profile(profile: Profile, device_memory: int | None = None, config: dict[str, Any] | None = None) -> Plan:
    """The KV-cache plan of one engine of `profile`."""
    if config is None:
        config, _ = load_model_config(profile)
    dtype = profile.vllm.get("dtype")
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPE_BYTES else None
    layout = kv_layout(config, profile.kv_cache_dtype, dtype)
    cfg = text_config(config)
    max_len = profile.max_model_len or int(cfg.get("max_position_embeddings") or 2048)
    weights = None
    if profile.device == "cpu":
        kv_memory = profile.cpu_kv_cache_bytes
        if kv_memory is None:
            raise PlanError(
                "a CPU profile needs env.VLLM_CPU_KVCACHE_SPACE (GiB) to plan with; "
                "without it vLLM sizes the cache from free RAM at start-up"
            )
        source = f"VLLM_CPU_KVCACHE_SPACE={profile.env['VLLM_CPU_KVCACHE_SPACE']} GiB"
    else:
        explicit = profile.vllm.get("kv-cache-memory-bytes")
        gpus = profile.tensor_parallel_size * profile.pipeline_parallel_size
        weights = profile.planner.weights_bytes or estimate_weight_bytes(config, dtype)
        if isinstance(explicit, int):
            kv_memory, source = explicit, "kv-cache-memory-bytes"
        elif device_memory is None:
            raise PlanError("a GPU profile needs --device-memory (memory of one GPU, e.g. 80GiB)")
        else:
            per_gpu = device_memory * profile.gpu_memory_utilization - weights / gpus - GPU_OVERHEAD_BYTES
            kv_memory = int(max(per_gpu, 0) * gpus)
            source = (
                f"{gpus} GPU x ({device_memory / GiB:.0f} GiB x {profile.gpu_memory_utilization}"
                f" - weights {weights / gpus / GiB:.1f} GiB - overhead {GPU_OVERHEAD_BYTES / GiB:.1f} GiB)"
            )
    blocks, tokens, sequences = capacity(layout, kv_memory, profile.block_size, max_len)
    min_tp = None
    if profile.device != "cpu" and device_memory is not None and sequences < 1:
        min_tp = smallest_tensor_parallel(layout, profile, device_memory, weights or 0, max_len)
    return Plan(
        profile=profile.name,
        model=profile.model,
        attention=layout.attention,
        kv_cache_dtype=profile.kv_cache_dtype,
        kv_bytes_per_token=layout.bytes_per_token,
        textbook_kv_bytes_per_token=layout.textbook_bytes_per_token,
        block_size=profile.block_size,
        bytes_per_block=layout.bytes_per_token * profile.block_size,
        kv_memory_bytes=kv_memory,
        kv_memory_source=source,
        num_blocks=blocks,
        kv_cache_tokens=tokens,
        max_model_len=max_len,
        blocks_per_sequence=blocks_per_sequence(layout, profile.block_size, max_len),
        max_concurrent_sequences=sequences,
        sliding_window=layout.sliding_window,
        sliding_window_layers=layout.sliding_window_layers,
        weights_bytes=weights,
        min_tensor_parallel_size=min_tp,
        layers=layout.layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
    )


def smallest_tensor_parallel(
    layout: KvLayout, profile: Profile, device_memory: int, weights: int, max_len: int, limit: int = 64
) -> int | None:
    """The smallest tensor-parallel size (pipeline size as in the profile) whose KV cache holds one
    sequence of `max_len` tokens, or None if even `limit` GPUs do not."""
    for tp in range(1, limit + 1):
        gpus = tp * profile.pipeline_parallel_size
        per_gpu = device_memory * profile.gpu_memory_utilization - weights / gpus - GPU_OVERHEAD_BYTES
        _, _, sequences = capacity(layout, int(max(per_gpu, 0) * gpus), profile.block_size, max_len)
        if sequences >= 1:
            return tp
    return None


def format_plan(plan: Plan) -> str:
    def size(n: int) -> str:
        return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} B"

    heads = "latent" if plan.attention == "mla" else f"{plan.kv_heads} KV heads"
    lines = [
        f"profile            {plan.profile} ({plan.model})",
        f"attention          {plan.attention.upper()}: {plan.layers} layers x {heads} x {plan.head_dim} dims, "
        f"kv-cache-dtype {plan.kv_cache_dtype}",
        f"KV bytes per token {plan.kv_bytes_per_token:,} B"
        + (
            f" (all-heads textbook formula: {plan.textbook_kv_bytes_per_token:,} B, "
            f"{plan.textbook_kv_bytes_per_token / plan.kv_bytes_per_token:.0f}x more)"
            if plan.textbook_kv_bytes_per_token != plan.kv_bytes_per_token
            else ""
        ),
        f"block              {plan.block_size} tokens = {size(plan.bytes_per_block)}",
        f"KV memory          {size(plan.kv_memory_bytes)} ({plan.kv_memory_source})",
        f"capacity           {plan.num_blocks:,} blocks = {plan.kv_cache_tokens:,} tokens",
        f"per sequence       {plan.max_model_len:,} tokens (max-model-len) = {plan.blocks_per_sequence:,} blocks",
        f"concurrent seqs    {plan.max_concurrent_sequences:,} at full max-model-len",
    ]
    if plan.sliding_window:
        lines.append(
            f"sliding window     {plan.sliding_window_layers} layers hold at most {plan.sliding_window:,} tokens"
        )
    if plan.weights_bytes is not None:
        lines.append(f"weights (est.)     {size(plan.weights_bytes)}")
    if plan.max_concurrent_sequences < 1:
        lines.append(
            f"does not fit       not one sequence of {plan.max_model_len:,} tokens: "
            + (
                f"needs tensor-parallel-size >= {plan.min_tensor_parallel_size}"
                if plan.min_tensor_parallel_size
                else "more GPUs than 64, or a lower max-model-len"
            )
        )
    return "\n".join(lines)


def report(profile_name: str, *, device_memory: str | None = None, as_json: bool = False) -> int:
    """`python -m server plan`: print a profile's KV-cache plan (exit 2 when it cannot be made)."""
    profile = load_profile(resolve_profile_path(profile_name))
    try:
        memory = parse_size(device_memory) if device_memory else None
        plan = plan_profile(profile, memory)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if as_json else format_plan(plan))
    return 0
