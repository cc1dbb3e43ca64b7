"""What a stand-in engine serves and how fast it generates: `StandinConfig` and the fixed constants.

The fault and per-request keys that `POST /_standin/faults` and a body's `"standin": {...}` accept
are listed here too, with the type each value is coerced to.
"""

from __future__ import annotations

import dataclasses

SYSTEM_FINGERPRINT = "vllm-0.32.0-standin"
VOCABULARY = (" The", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " again")
TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
PREFIX_BLOCK_WORDS = 16  # "block size" of the stand-in's prefix cache, in tokens (= words)
PREFIX_CACHE_BLOCKS = 50_000
TIMINGS_KEPT = 100_000  # engine-side timings of this many recent requests are kept

FAULT_KEYS = {
    "health_status": int,
    "status": int,
    "die_after_chunks": int,
    "first_byte_delay_s": float,
    "stall_after_chunks": int,
    "stall_s": float,
    "tokenize_status": int,
    "kv_cache_usage_perc": float,
    "metrics_status": int,
    "metrics_text": str,
    "ttft_ms": float,
    "itl_ms": float,
    "tokens": int,
    "hold": bool,
    "times": int,
}
REQUEST_KEYS = {
    "status", "die_after_chunks", "first_byte_delay_s", "stall_after_chunks", "stall_s",
    "ttft_ms", "itl_ms", "tokens",
}  # fmt: skip


@dataclasses.dataclass
class StandinConfig:
    """What the stand-in engine serves and how fast it generates."""

    model: str = "standin"
    ttft_ms: float = 20.0
    itl_ms: float = 10.0
    tokens: int = 32  # tokens generated when max_tokens does not stop earlier
    max_model_len: int = 4096
    strict_context: bool = True  # 400 when prompt + max_tokens > max_model_len
    kv_cache_tokens: int = 65536  # capacity behind vllm:kv_cache_usage_perc
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
