"""The `gateway_engine_*` families: read from the same Engine objects routing reads, no I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.replicas.collector import EngineCollector
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.scraper import parse_engine_metrics
from tests.gateway.replicas.test_scraper import VLLM_TEXT, scrape

# The exposition the collector produced before the engine model was unified (dashboards and alert
# rules query it): names, help texts, types, label order, which series are absent.
EXPECTED = (Path(__file__).parent / "data" / "gateway-engine-metrics.prom").read_text()


def test_output_is_what_dashboards_and_alerts_were_written_against():
    scraped = Engine("tiny", "http://127.0.0.1:8100", planned_kv_tokens=900_000)
    scraped.record_scrape(parse_engine_metrics(VLLM_TEXT), at=1_700_000_000.0)
    never = Engine("tiny", "http://127.0.0.1:8101")  # not scraped yet, no plan
    failed = Engine("other", "http://10.0.0.7:8000")  # scraped once, then failed
    failed.record_scrape(parse_engine_metrics(VLLM_TEXT), at=1_600_000_000.0)
    failed.record_scrape_failure("ConnectError()")
    registry = CollectorRegistry()
    registry.register(EngineCollector([scraped, never, failed]))
    assert generate_latest(registry).decode() == EXPECTED


def test_the_collector_reads_the_engines_as_they_are_now():
    engine = Engine("tiny", "http://127.0.0.1:8100")
    registry = CollectorRegistry()
    registry.register(EngineCollector([engine]))
    labels = frozenset({"model": "tiny", "engine": "127.0.0.1:8100"}.items())
    assert scrape(registry)[("gateway_engine_up", labels)] == 0
    engine.record_scrape(parse_engine_metrics(VLLM_TEXT), at=1.0)
    got = scrape(registry)
    assert got[("gateway_engine_up", labels)] == 1
    assert got[("gateway_engine_kv_cache_usage_ratio", labels)] == engine.metrics.kv_usage


def test_collector_shares_the_gateway_registry_and_refuses_duplicates():
    metrics = GatewayMetrics()
    engine = Engine("tiny", "http://127.0.0.1:9")
    metrics.registry.register(EngineCollector([engine]))
    metrics.request_started("tiny")
    names = {name for name, _ in scrape(metrics.registry)}
    assert {"gateway_engine_up", "gateway_requests_in_flight"} <= names
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        metrics.registry.register(EngineCollector([engine]))
