"""Bytes of weights on each GPU of an engine, from config.json, as vLLM shards and loads them.

The model is walked as its layers are built: attention (GQA/MHA or MLA), a dense MLP or a MoE
block (router, routed experts, shared experts) per layer, the embedding on the first pipeline
stage and the output head (with the final norm) on the last. Each linear layer is split the way
vLLM's parallel linear layers split it (column, row, replicated, experts over `tp x dp`, see
server.engine.parallel) and stored in the checkpoint's weight format
(server.engine.quantization); norms, embeddings and routers stay at the model's dtype. Biases,
rotary caches and the multi-token-prediction layers vLLM loads only for speculative decoding
are left out (well under 1% of a model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from server.engine.parallel import Layout, kv_heads_per_rank, padded_vocab_rows, stage_layers
from server.engine.quantization import WeightFormat


@dataclass(frozen=True)
class ModelShape:
    """The numbers of config.json that size the weights."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied: bool
    # MLA (0 when absent)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    # MoE (0 experts: dense)
    experts: int
    moe_intermediate: int
    shared_intermediate: int
    moe_layers: tuple[bool, ...]
    qk_norm: int = 0  # per-head RMS norms of q and k (Qwen3): 2 x head_dim a layer

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0


def _int(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            return int(value)
    return default


def model_shape(cfg: dict[str, Any]) -> ModelShape:
    """The shape of a (text) config.json mapping."""
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    experts = _int(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    moe_inter = _int(cfg, "moe_intermediate_size", "intermediate_size") if experts else 0
    shared = _int(cfg, "n_shared_experts") * moe_inter or _int(cfg, "shared_expert_intermediate_size")
    first_dense = _int(cfg, "first_k_dense_replace")
    freq = _int(cfg, "moe_layer_freq", "decoder_sparse_step", default=1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    if "decoder_sparse_step" in cfg:  # Qwen-MoE: layer i is sparse when (i + 1) % step == 0
        moe = tuple(bool(experts) and i not in dense_only and (i + 1) % freq == 0 for i in range(layers))
    else:  # DeepSeek: dense below first_k_dense_replace, then every moe_layer_freq-th
        moe = tuple(bool(experts) and i >= first_dense and i % freq == 0 and i not in dense_only for i in range(layers))
    return ModelShape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=_int(cfg, "head_dim") or hidden // heads,
        vocab=_int(cfg, "vocab_size"),
        intermediate=_int(cfg, "intermediate_size", default=4 * hidden),
        tied=bool(cfg.get("tie_word_embeddings")),
        q_lora_rank=_int(cfg, "q_lora_rank"),
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope=_int(cfg, "qk_nope_head_dim"),
        qk_rope=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
        experts=experts,
        moe_intermediate=moe_inter,
        shared_intermediate=shared,
        moe_layers=moe,
        qk_norm=2 * (_int(cfg, "head_dim") or hidden // heads) if str(cfg.get("model_type")).startswith("qwen3") else 0,
    )


@dataclass(frozen=True)
class WeightCounter:
    """Adds up one rank's weights: linear layers in the checkpoint's format, the rest at `dtype_bytes`."""

    fmt: WeightFormat
    dtype_bytes: int

    def linear(self, name: str, out_features: int, in_features: int, *, expert: bool = False) -> int:
        quantized = self.fmt.quantizes(name, expert=expert)
        return self.fmt.linear_bytes(out_features, in_features, self.dtype_bytes, quantized=quantized)

    def plain(self, count: int) -> int:
        return count * self.dtype_bytes


def attention_bytes(s: ModelShape, layout: Layout, w: WeightCounter, prefix: str) -> int:
    tp = layout.tp
    if s.mla:
        qk = s.qk_nope + s.qk_rope
        if s.q_lora_rank:
            q = w.linear(f"{prefix}.q_a_proj", s.q_lora_rank, s.hidden)  # replicated
            q += w.plain(s.q_lora_rank)  # q_a_layernorm
            q += w.linear(f"{prefix}.q_b_proj", s.heads // tp * qk, s.q_lora_rank)
        else:
            q = w.linear(f"{prefix}.q_proj", s.heads // tp * qk, s.hidden)
        kv = w.linear(f"{prefix}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope, s.hidden)  # replicated
        kv += w.plain(s.kv_lora_rank)  # kv_a_layernorm
        kv += w.linear(f"{prefix}.kv_b_proj", s.heads // tp * (s.qk_nope + s.v_head_dim), s.kv_lora_rank)
        out = w.linear(f"{prefix}.o_proj", s.hidden, s.heads // tp * s.v_head_dim)
        return q + kv + out
    kv_rows = kv_heads_per_rank(s.kv_heads, tp, mla=False) * s.head_dim
    q = w.linear(f"{prefix}.q_proj", s.heads // tp * s.head_dim, s.hidden)
    k = w.linear(f"{prefix}.k_proj", kv_rows, s.hidden)
    v = w.linear(f"{prefix}.v_proj", kv_rows, s.hidden)
    out = w.linear(f"{prefix}.o_proj", s.hidden, s.heads // tp * s.head_dim)
    return q + k + v + out


def mlp_bytes(
    w: WeightCounter, prefix: str, hidden: int, intermediate: int, shards: int, *, expert: bool = False
) -> int:
    """gate, up and down projections with the intermediate size split over `shards` ranks."""
    inter = math.ceil(intermediate / shards)
    return (
        w.linear(f"{prefix}.gate_proj", inter, hidden, expert=expert)
        + w.linear(f"{prefix}.up_proj", inter, hidden, expert=expert)
        + w.linear(f"{prefix}.down_proj", hidden, inter, expert=expert)
    )


def moe_bytes(s: ModelShape, layout: Layout, w: WeightCounter, prefix: str) -> int:
    router = w.plain(s.experts * s.hidden)  # replicated, never quantized by vLLM
    shards = layout.moe_shards
    if layout.ep:  # whole experts per rank; the busiest rank has the rounded-up share
        local = math.ceil(s.experts / shards)
        experts = local * mlp_bytes(w, f"{prefix}.experts.0", s.hidden, s.moe_intermediate, 1, expert=True)
    else:  # every expert sliced over the ranks
        experts = s.experts * mlp_bytes(w, f"{prefix}.experts.0", s.hidden, s.moe_intermediate, shards, expert=True)
    shared = 0
    if s.shared_intermediate:
        shared = mlp_bytes(w, f"{prefix}.shared_experts", s.hidden, s.shared_intermediate, layout.tp)
    return router + experts + shared


def stage_weight_bytes(s: ModelShape, layout: Layout, w: WeightCounter, stage: int) -> int:
    """Weights of one GPU of pipeline stage `stage` (0-based)."""
    start, end = stage_layers(s.layers, layout.pp)[stage]
    total = 0
    for i in range(start, end):
        prefix = f"model.layers.{i}"
        total += w.plain(2 * s.hidden + s.qk_norm)  # input and post-attention norms (and Qwen3's q/k norms)
        total += attention_bytes(s, layout, w, f"{prefix}.self_attn")
        if s.moe_layers[i]:
            total += moe_bytes(s, layout, w, f"{prefix}.mlp")
        else:
            total += mlp_bytes(w, f"{prefix}.mlp", s.hidden, s.intermediate, layout.tp)
    rows = padded_vocab_rows(s.vocab, layout.tp)
    if stage == 0:
        total += w.plain(rows * s.hidden)  # embed_tokens
    if stage == layout.pp - 1:
        total += w.plain(s.hidden)  # final norm
        if not s.tied or layout.pp > 1:  # tied: one tensor on a single stage, a copy on the last
            total += w.linear("lm_head", rows, s.hidden)
    return total


def parameter_count(s: ModelShape) -> int:
    """Parameters of the model as published (no padding, no sharding)."""
    count = 0
    counter = WeightCounter(WeightFormat(method="none"), 1)
    one = Layout()
    for i in range(s.layers):
        count += 2 * s.hidden + s.qk_norm + attention_bytes(s, one, counter, "a")
        count += moe_bytes(s, one, counter, "m") if s.moe_layers[i] else 3 * s.hidden * s.intermediate
    return count + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden
