"""The stand-in's `/metrics`: vLLM's metric names, types and help texts, the labels vLLM 0.32
puts on them, and values taken from the engine's own state (running requests, KV tokens in use,
the prefix cache's counters, `vllm:cache_config_info` with the block size).
"""

from __future__ import annotations

from standin.config import PREFIX_BLOCK_WORDS, StandinConfig
from standin.prefix_cache import PrefixCache


def render_metrics(config: StandinConfig, running: int, usage: float, prefix: PrefixCache) -> str:
    """The Prometheus text exposition of one engine (`usage`: KV-cache usage, 0..1)."""
    labels = f'engine="0",model_name="{config.model}"'
    block = PREFIX_BLOCK_WORDS
    lines = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
         f"{{{labels}}} {float(running)}"),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         f"{{{labels}}} 0.0"),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         f"{{{labels}}} {float(usage)}"),
        ("vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.",
         f"{{{labels}}} {float(prefix.queries)}"),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
         f"{{{labels}}} {float(prefix.hits)}"),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
         f"{{{labels}}} 0.0"),
        ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
         f'{{block_size="{block}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
         f'kv_cache_size_tokens="{config.kv_cache_tokens}",'
         f'num_gpu_blocks="{config.kv_cache_tokens // block}"}} 1.0'),
    ]  # fmt: skip
    return "".join(
        f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{sample}\n" for name, kind, help_, sample in lines
    )
