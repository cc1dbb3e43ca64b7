"""The engines' figures on the gateway's own /metrics: `gateway_engine_*`, one series per engine.

A custom Collector over the pool's `Engine` objects, the same ones routing reads: it reports what
the scraper (and the profile's plan) wrote there, and does no I/O, so a Prometheus scrape of the
gateway never waits for an engine. A value the engine did not export has no series. Dashboards
(docker/grafana) and alert rules (docker/prometheus/alerts.yml) query these names: change them
together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.gateway.replicas.engine import Engine

LABELS = ("model", "engine")


@dataclass(frozen=True, slots=True)
class _Family:
    kind: type[GaugeMetricFamily | CounterMetricFamily]
    name: str  # a counter's gets `_total` in the exposition
    help: str
    value: Callable[[Engine], float | None]  # None: no sample for this engine


def _planned(engine: Engine) -> float | None:
    return None if engine.planned_kv_tokens is None else float(engine.planned_kv_tokens)


FAMILIES = (
    _Family(
        GaugeMetricFamily,
        "gateway_engine_up",
        "1 if the engine's last /metrics scrape succeeded, else 0.",
        lambda e: 1.0 if e.metrics_up else 0.0,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_last_scrape_timestamp_seconds",
        "Unix time of the engine's last successful /metrics scrape.",
        lambda e: e.scraped_at,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_kv_cache_usage_ratio",
        "KV-cache blocks in use, 0..1 (vllm:kv_cache_usage_perc; evictable cached blocks count as free).",
        lambda e: e.metrics.kv_usage,
    ),
    _Family(
        CounterMetricFamily,
        "gateway_engine_prefix_cache_queries",
        "Prompt tokens looked up in the engine's prefix cache (vllm:prefix_cache_queries).",
        lambda e: e.metrics.prefix_queries_tokens,
    ),
    _Family(
        CounterMetricFamily,
        "gateway_engine_prefix_cache_hits",
        "Prompt tokens found in the engine's prefix cache (vllm:prefix_cache_hits).",
        lambda e: e.metrics.prefix_hits_tokens,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_requests_running",
        "Requests in the engine's running batch.",
        lambda e: e.metrics.running,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_requests_waiting",
        "Requests queued in the engine.",
        lambda e: e.metrics.waiting,
    ),
    _Family(
        CounterMetricFamily,
        "gateway_engine_preemptions",
        "Requests the engine preempted (KV cache full).",
        lambda e: e.metrics.preemptions,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_kv_cache_capacity_tokens",
        "KV-cache capacity the engine reports, in tokens (vllm:cache_config_info).",
        lambda e: e.metrics.kv_capacity_tokens,
    ),
    _Family(
        GaugeMetricFamily,
        "gateway_engine_kv_cache_planned_tokens",
        "KV-cache capacity the engine's profile planned for, in tokens.",
        _planned,
    ),
)


class EngineCollector(Collector):
    """Yields the `gateway_engine_*` families from `engines` as they are now; does no I/O.

    Register it on the gateway's registry: `registry.register(EngineCollector(pool.engines()))`,
    or `EngineCollector(pool.engines)` to read the engines at each collection (engines found by DNS).
    """

    def __init__(self, engines: Iterable[Engine] | Callable[[], Iterable[Engine]]) -> None:
        if callable(engines):
            self._source = engines
        else:
            fixed = list(engines)
            self._source = lambda: fixed

    @property
    def _engines(self) -> list[Engine]:
        return list(self._source())

    def describe(self) -> Iterator[Metric]:
        for family in FAMILIES:
            yield family.kind(family.name, family.help, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        for family in FAMILIES:
            metric = family.kind(family.name, family.help, labels=LABELS)
            for engine in self._engines:
                value = family.value(engine)
                if value is not None:
                    metric.add_metric((engine.model, engine.id), value)
            yield metric
