"""When a model's engines are full, as the gateway can know it without asking them.

An engine has room for `max-num-seqs` running requests (vLLM's batch; more wait in its own FCFS
queue, where priority classes and fair shares cannot reach them). The gateway knows exactly how
many requests it has in flight on each engine (counted on the request path, no lag), while the
engine's `vllm:num_requests_waiting` and KV usage come from a scrape up to
`metrics_scrape_interval` old. So the gate is the gateway's own count: a model is saturated when
the requests this process has in flight reach its share of the healthy engines' `max-num-seqs`;
an engine whose scraped KV usage is at `kv_usage_limit` counts as full too (long prompts can fill
the KV cache before the batch is full: vLLM would then queue or preempt). The scraped waiting
queue is not a gate: a stale non-zero reading would hold requests while the engine sits idle
(not work-conserving). It is shown beside the gate (`gateway_flow_engine_saturation`) and is
what reveals traffic the gate does not count (other gateway replicas, direct clients).
"""

from __future__ import annotations

from collections.abc import Iterable

from server.gateway.replicas.engine import Engine


def capacity(engines: Iterable[Engine], max_num_seqs: int, kv_usage_limit: float, workers: int = 1) -> int:
    """Requests this process may have in flight on the model: its share of every healthy engine's
    batch that is not full (at least 1 per such engine, so each worker can use each engine)."""
    share = max(1, -(-max_num_seqs // max(1, workers)))
    room = 0
    for engine in engines:  # (a loop, not a generator: this runs for every request at the gate)
        if engine.healthy:  # and its KV cache, by its last scrape, below the limit
            usage = engine.metrics.kv_usage
            if usage is None or usage < kv_usage_limit:
                room += share
    return room


def saturation(engine: Engine, max_num_seqs: int) -> float:
    """How full the engine's batch is as the gateway counts it: its in-flight requests over
    `max-num-seqs` (above 1: requests the engine queues)."""
    return engine.outstanding / max_num_seqs if max_num_seqs else 0.0
