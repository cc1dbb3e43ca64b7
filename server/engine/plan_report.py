"""`python -m server plan PROFILE`: a profile's plan in words, or as one JSON object."""

from __future__ import annotations

import json
import sys

from server.engine.parallel import Layout
from server.engine.planner import MAX_GPUS, Plan, PlanError, parse_size, plan_profile
from server.engine.profiles import load_profile, resolve_profile_path

GiB = 2**30


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
