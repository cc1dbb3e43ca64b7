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
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.engine.kv import (
    DTYPE_BYTES,
    KvLayout,
    blocks_per_sequence,
    kv_layout,
    model_dtype,
    rank_layout,
    text_config,
)
from server.engine.kv import (
    PlanError as PlanError,  # the planner's error (defined with the arithmetic that raises it)
)
from server.engine.parallel import Layout, layout_problem, stage_layers
from server.engine.profiles import Profile
from server.engine.quantization import QuantizationError, weight_format
from server.engine.weights import WeightCounter, model_shape, stage_weight_bytes

GiB = 2**30
# What vLLM itself keeps out of the KV budget on a GPU besides weights (activations of the
# profiling run, CUDA graphs, the non-torch allocator): an assumption, stated in the output.
GPU_OVERHEAD_BYTES = int(1.5 * GiB)


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
