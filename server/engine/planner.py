"""KV-cache arithmetic for a profile, from the model's own config.json, rank by rank.

Bytes per token of a paged KV cache are 2 (K and V) x layers x KV heads x head_dim x dtype
bytes. Grouped-query attention caches only `num_key_value_heads`, not every attention head;
multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent of
`kv_lora_rank + qk_rope_head_dim` per layer instead of K and V; sliding-window layers hold at
most the window. vLLM hands out memory in blocks of `block-size` tokens, so capacity is whole
blocks.

An engine is planned as vLLM allocates it (server.engine.parallel): each GPU holds its pipeline
stage's layers, `max(1, kv_heads // tp)` KV heads (MLA: the whole latent on every rank) and its
share of the weights (server.engine.weights, in the checkpoint's format:
server.engine.quantization); every rank gets as many blocks as the fullest one holds; each
data-parallel rank has a cache of its own. The pure functions here are what the tests check
against hand-computed values and against vLLM's own config classes; `plan` ties them to a
profile and the memory it gets.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.engine.parallel import Layout, kv_heads_per_rank, layout_problem, stage_layers
from server.engine.profiles import FP8_KV_CACHE_DTYPES, Profile, load_profile, resolve_profile_path
from server.engine.quantization import QuantizationError, weight_format
from server.engine.weights import WeightCounter, model_shape, stage_weight_bytes

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp16": 2, "bf16": 2}
# What vLLM itself keeps out of the KV budget on a GPU besides weights (activations of the
# profiling run, CUDA graphs, the non-torch allocator): an assumption, stated in the output.
GPU_OVERHEAD_BYTES = int(1.5 * GiB)
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


def estimate_weight_bytes(config: dict[str, Any], dtype: str | None = None) -> int:
    """Bytes of a dense or MoE decoder's weights on one GPU (no parallelism), in the checkpoint's
    format (`quantization_config`) with embeddings and norms at the model's dtype."""
    return rank_weight_bytes(config, Layout(), 0, dtype)


def rank_weight_bytes(config: dict[str, Any], layout: Layout, stage: int, dtype: str | None = None) -> int:
    """Bytes of weights on one GPU of pipeline stage `stage` under `layout`."""
    cfg = text_config(config)
    try:
        shape = model_shape(cfg)
        fmt = weight_format(config)
    except KeyError as exc:
        raise PlanError(f"config.json has no {exc.args[0]!r}") from None
    except QuantizationError as exc:
        raise PlanError(str(exc)) from None
    nbytes = DTYPE_BYTES.get(dtype or model_dtype(cfg), 2)
    return stage_weight_bytes(shape, layout, WeightCounter(fmt, nbytes), stage)


def parse_size(text: str) -> int:
    """'80GiB', '24GB', '512MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not match:
        raise PlanError(f"cannot read the size {text!r}; write e.g. 80GiB or 24GB")
    number = float(match.group(1))
    unit = (match.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(number * scale)


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


@dataclass(frozen=True)
class RankPlan:
    """One GPU of each pipeline stage (every TP and DP rank of a stage holds the same)."""

    pipeline_rank: int
    layers: tuple[int, int]  # [start, end) of the model's layers
    kv_heads: int  # KV heads this rank caches (1 for MLA: its latent)
    kv_bytes_per_token: int  # this rank's share of one token (its layers, its heads)
    weights_bytes: int | None
    kv_memory_bytes: int
    num_blocks: int  # what this rank's memory holds; the engine uses the smallest of all ranks


@dataclass(frozen=True)
class Plan:
    profile: str
    model: str
    attention: str
    kv_cache_dtype: str
    kv_bytes_per_token: int  # the whole model's (one copy of every layer and KV head)
    textbook_kv_bytes_per_token: int
    block_size: int
    bytes_per_block: int
    kv_memory_bytes: int  # over every GPU of the engine
    kv_memory_source: str
    num_blocks: int  # blocks of one data-parallel rank's cache (vLLM's num_gpu_blocks)
    kv_cache_tokens: int  # over every data-parallel rank
    max_model_len: int
    blocks_per_sequence: int
    max_concurrent_sequences: int  # over every data-parallel rank
    sliding_window: int | None
    sliding_window_layers: int
    weights_bytes: int | None  # the whole model as loaded (one copy, no parallelism)
    # A GPU plan that holds no sequence at max-model-len: the smallest tensor-parallel size that
    # would (the profile's pipeline and data parallel sizes kept), and the smallest layouts of each kind.
    min_tensor_parallel_size: int | None
    layers: int
    kv_heads: int
    head_dim: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    gpus: int = 1
    weight_format: str = "none"
    kv_cache_tokens_per_dp_rank: int = 0
    max_concurrent_sequences_per_dp_rank: int = 0
    kv_bytes_per_token_all_ranks: int = 0  # what a token costs summed over the GPUs of one DP rank
    ranks: tuple[RankPlan, ...] = ()
    device: str = "gpu"
    fitting_layouts: tuple[dict[str, Any], ...] = ()

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


def profile_layout(profile: Profile) -> Layout:
    return Layout(
        tp=profile.tensor_parallel_size,
        pp=profile.pipeline_parallel_size,
        dp=profile.data_parallel_size,
        ep=profile.enable_expert_parallel,
    )


@dataclass(frozen=True)
class _Fit:
    ranks: tuple[RankPlan, ...]
    blocks: int  # per DP rank: the smallest of its ranks
    per_sequence: int
    sequences: int  # per DP rank


def _fit(
    layout: KvLayout,
    parallel: Layout,
    config: dict[str, Any],
    *,
    block_size: int,
    max_len: int,
    dtype: str | None,
    rank_memory: int | None,
    device_memory: int | None = None,
    utilization: float = 0.9,
    weights_hint: int | None = None,
) -> _Fit:
    """Each pipeline stage's rank: weights, KV memory and blocks; the DP rank's blocks and sequences.

    `rank_memory`: the KV memory of every rank as given (CPU space, kv-cache-memory-bytes);
    otherwise the device's usable memory less the rank's weights and the overhead.
    """
    ranks = []
    per_sequence = 0
    for stage in range(parallel.pp):
        kv = rank_layout(layout, parallel, stage)
        weights = None
        if rank_memory is not None:
            memory = rank_memory
        else:
            assert device_memory is not None
            weights = weights_hint if weights_hint is not None else rank_weight_bytes(config, parallel, stage, dtype)
            memory = int(max(device_memory * utilization - weights - GPU_OVERHEAD_BYTES, 0))
        blocks = memory // (kv.bytes_per_token * block_size) if memory > 0 else 0
        per_sequence = max(per_sequence, blocks_per_sequence(kv, block_size, max_len))
        start_end = stage_layers(layout.layers, parallel.pp)[stage]
        ranks.append(RankPlan(stage, start_end, kv.kv_heads or 1, kv.bytes_per_token, weights, memory, blocks))
    blocks = min(rank.num_blocks for rank in ranks)
    return _Fit(tuple(ranks), blocks, per_sequence, blocks // per_sequence if per_sequence else 0)


def _check_layout(cfg: dict[str, Any], layout: KvLayout, parallel: Layout) -> None:
    experts = model_shape(cfg).experts if "hidden_size" in cfg else 0
    heads = int(cfg["num_attention_heads"])
    kv_heads = 0 if layout.attention == "mla" else layout.kv_heads
    problem = layout_problem(parallel, heads=heads, kv_heads=kv_heads, layers=layout.layers, experts=experts)
    if problem:
        raise PlanError(f"vLLM refuses this layout: {problem}")


def plan_profile(profile: Profile, device_memory: int | None = None, config: dict[str, Any] | None = None) -> Plan:
    """The KV-cache plan of one engine of `profile`, rank by rank."""
    if config is None:
        config, _ = load_model_config(profile)
    dtype = profile.vllm.get("dtype")
    dtype = dtype if isinstance(dtype, str) and dtype in DTYPE_BYTES else None
    layout = kv_layout(config, profile.kv_cache_dtype, dtype)
    cfg = text_config(config)
    max_len = profile.max_model_len or int(cfg.get("max_position_embeddings") or 2048)
    parallel = profile_layout(profile)
    _check_layout(cfg, layout, parallel)
    try:
        fmt = weight_format(config).method
    except QuantizationError as exc:
        raise PlanError(str(exc)) from None
    weights = None
    rank_memory: int | None = None
    if profile.device == "cpu":
        rank_memory = profile.cpu_kv_cache_bytes
        if rank_memory is None:
            raise PlanError(
                "a CPU profile needs env.VLLM_CPU_KVCACHE_SPACE (GiB) to plan with; "
                "without it vLLM sizes the cache from free RAM at start-up"
            )
        source = f"VLLM_CPU_KVCACHE_SPACE={profile.env['VLLM_CPU_KVCACHE_SPACE']} GiB"
    else:
        explicit = profile.vllm.get("kv-cache-memory-bytes")
        weights = estimate_weight_bytes(config, dtype)
        if isinstance(explicit, int):
            rank_memory, source = explicit, "kv-cache-memory-bytes"
        elif device_memory is None:
            raise PlanError("a GPU profile needs --device-memory (memory of one GPU, e.g. 80GiB)")
        else:
            source = (
                f"{parallel.gpus} GPU x ({device_memory / GiB:.0f} GiB x {profile.gpu_memory_utilization}"
                f" - weights of the rank - overhead {GPU_OVERHEAD_BYTES / GiB:.1f} GiB)"
            )
    common = dict(block_size=profile.block_size, max_len=max_len, dtype=dtype)
    fit = _fit(
        layout,
        parallel,
        config,
        rank_memory=rank_memory,
        device_memory=device_memory,
        utilization=profile.gpu_memory_utilization,
        weights_hint=profile.planner.weights_bytes,
        **common,  # type: ignore[arg-type]
    )
    min_tp = None
    fitting: tuple[dict[str, Any], ...] = ()
    if profile.device != "cpu" and rank_memory is None and device_memory is not None and fit.sequences < 1:

        def fits(candidate: Layout) -> bool:
            try:
                _check_layout(cfg, layout, candidate)
            except PlanError:
                return False
            return (
                _fit(
                    layout,
                    candidate,
                    config,
                    rank_memory=None,
                    device_memory=device_memory,
                    utilization=profile.gpu_memory_utilization,
                    **common,  # type: ignore[arg-type]
                ).sequences
                >= 1
            )

        min_tp = next(
            (tp for tp in range(1, MAX_GPUS + 1) if fits(Layout(tp, parallel.pp, parallel.dp, parallel.ep))), None
        )
        fitting = tuple(
            {**asdict(found), "gpus": found.gpus, "layout": found.describe(), "flags": found.flags()}
            for found in smallest_fitting_layouts(fits, moe=model_shape(cfg).experts > 0)
        )
    tokens_per_dp = fit.blocks * profile.block_size
    all_ranks = parallel.tp * sum(rank.kv_bytes_per_token for rank in fit.ranks)
    return Plan(
        profile=profile.name,
        model=profile.model,
        attention=layout.attention,
        kv_cache_dtype=profile.kv_cache_dtype,
        kv_bytes_per_token=layout.bytes_per_token,
        textbook_kv_bytes_per_token=layout.textbook_bytes_per_token,
        block_size=profile.block_size,
        bytes_per_block=layout.bytes_per_token * profile.block_size,
        kv_memory_bytes=parallel.dp * parallel.tp * sum(rank.kv_memory_bytes for rank in fit.ranks),
        kv_memory_source=source,
        num_blocks=fit.blocks,
        kv_cache_tokens=parallel.dp * tokens_per_dp,
        max_model_len=max_len,
        blocks_per_sequence=fit.per_sequence,
        max_concurrent_sequences=parallel.dp * fit.sequences,
        sliding_window=layout.sliding_window,
        sliding_window_layers=layout.sliding_window_layers,
        weights_bytes=weights,
        min_tensor_parallel_size=min_tp,
        layers=layout.layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        tensor_parallel_size=parallel.tp,
        pipeline_parallel_size=parallel.pp,
        data_parallel_size=parallel.dp,
        expert_parallel=parallel.ep,
        gpus=parallel.gpus,
        weight_format=fmt,
        kv_cache_tokens_per_dp_rank=tokens_per_dp,
        max_concurrent_sequences_per_dp_rank=fit.sequences,
        kv_bytes_per_token_all_ranks=all_ranks,
        ranks=fit.ranks,
        device=profile.device,
        fitting_layouts=fitting,
    )


MAX_GPUS = 64  # the largest engine the layout search looks at (8 nodes of 8)
GPUS_PER_NODE = 8


def smallest_fitting_layouts(fits: Callable[[Layout], bool], *, moe: bool) -> list[Layout]:
    """The smallest layout of each kind that `fits`: TP alone, TP within a node x PP across
    nodes, and (for MoE models) DP + EP. Sizes are powers of two, as GPUs come."""
    sizes = [2**i for i in range(MAX_GPUS.bit_length()) if 2**i <= MAX_GPUS]
    found: list[Layout] = []
    tp_only = next((Layout(tp=n) for n in sizes if fits(Layout(tp=n))), None)
    if tp_only:
        found.append(tp_only)
    tp_pp = next(
        (
            Layout(tp=tp, pp=n // tp)
            for n in sizes
            for tp in sorted((t for t in sizes if t <= min(n, GPUS_PER_NODE)), reverse=True)
            if n // tp > 1 and fits(Layout(tp=tp, pp=n // tp))
        ),
        None,
    )
    if tp_pp:
        found.append(tp_pp)
    if moe:
        dp_ep = next((Layout(dp=n, ep=True) for n in sizes if n > 1 and fits(Layout(dp=n, ep=True))), None)
        if dp_ep:
            found.append(dp_ep)
    return found


def format_plan(plan: Plan) -> str:
    def size(n: int) -> str:
        return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} B"

    heads = "latent" if plan.attention == "mla" else f"{plan.kv_heads} KV heads"
    layout = Layout(
        plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.data_parallel_size, plan.expert_parallel
    )
    where = layout.describe() if plan.device == "gpu" else layout.describe().split(" (")[0] + " (CPU)"
    lines = [
        f"profile            {plan.profile} ({plan.model})",
        f"layout             {where}",
        f"attention          {plan.attention.upper()}: {plan.layers} layers x {heads} x {plan.head_dim} dims, "
        f"kv-cache-dtype {plan.kv_cache_dtype}",
        f"KV bytes per token {plan.kv_bytes_per_token:,} B for the whole model"
        + (
            f" (all-heads textbook formula: {plan.textbook_kv_bytes_per_token:,} B, "
            f"{plan.textbook_kv_bytes_per_token / plan.kv_bytes_per_token:.0f}x more)"
            if plan.textbook_kv_bytes_per_token != plan.kv_bytes_per_token
            else ""
        ),
    ]
    if plan.tensor_parallel_size * plan.pipeline_parallel_size > 1:
        lines.append(
            f"  on the GPUs      {plan.kv_bytes_per_token_all_ranks:,} B summed over the "
            f"{plan.tensor_parallel_size * plan.pipeline_parallel_size} GPUs of one DP rank"
            + (
                f" ({plan.kv_bytes_per_token_all_ranks / plan.kv_bytes_per_token:.1f}x: heads replicated)"
                if plan.kv_bytes_per_token_all_ranks > plan.kv_bytes_per_token
                else ""
            )
        )
    if plan.weights_bytes is not None:
        loaded = plan.weight_format if plan.weight_format != "none" else "no quantization_config"
        lines.append(f"weights (est.)     {size(plan.weights_bytes)} as loaded ({loaded})")
    lines.append("per rank           stage  layers    KV heads  KV B/token  weights     KV memory   blocks")
    for rank in plan.ranks:
        weights = size(rank.weights_bytes) if rank.weights_bytes is not None else "-"
        lines.append(
            f"                   {rank.pipeline_rank:>5}  {rank.layers[0]:>3}-{rank.layers[1] - 1:<3}  "
            f"{rank.kv_heads:>8}  {rank.kv_bytes_per_token:>10,}  {weights:>10}  {size(rank.kv_memory_bytes):>10}"
            f"  {rank.num_blocks:>7,}"
        )
    lines += [
        f"block              {plan.block_size} tokens = {size(plan.bytes_per_block)} (whole model)",
        f"KV memory          {size(plan.kv_memory_bytes)}{' over all GPUs' if plan.device == 'gpu' else ''}"
        f" ({plan.kv_memory_source})",
        f"capacity           {plan.num_blocks:,} blocks = {plan.kv_cache_tokens_per_dp_rank:,} tokens"
        + (
            f" per DP rank, x {plan.data_parallel_size} = {plan.kv_cache_tokens:,} tokens"
            if plan.data_parallel_size > 1
            else ""
        ),
        f"per sequence       {plan.max_model_len:,} tokens (max-model-len) = {plan.blocks_per_sequence:,} blocks",
        f"concurrent seqs    {plan.max_concurrent_sequences:,} at full max-model-len"
        + (f" ({plan.max_concurrent_sequences_per_dp_rank:,} per DP rank)" if plan.data_parallel_size > 1 else ""),
    ]
    if plan.sliding_window:
        lines.append(
            f"sliding window     {plan.sliding_window_layers} layers hold at most {plan.sliding_window:,} tokens"
        )
    if plan.max_concurrent_sequences < 1:
        lines.append(
            f"does not fit       not one sequence of {plan.max_model_len:,} tokens: "
            + (
                f"needs tensor-parallel-size >= {plan.min_tensor_parallel_size}"
                if plan.min_tensor_parallel_size
                else f"more GPUs than {MAX_GPUS}, or a lower max-model-len"
            )
        )
        for found in plan.fitting_layouts:
            flags = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in found["flags"].items())
            lines.append(f"  would fit       {found['layout']}: {flags}")
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
