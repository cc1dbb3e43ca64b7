"""GatewayMetrics: what each method records, read back from the exposition text a scrape sees."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.observability.metrics import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    OTHER_MODEL,
    TTFT_BUCKETS,
    GatewayMetrics,
)


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape of `metrics.registry`, by (name, labels)."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


def test_own_registry_per_instance_and_injected_registry_used():
    a, b = GatewayMetrics(), GatewayMetrics()  # no duplicate-registration error: own registries
    assert a.registry is not b.registry
    registry = CollectorRegistry()
    assert GatewayMetrics(registry).registry is registry


def test_counters_by_status_code_and_in_flight():
    m = GatewayMetrics()
    for _ in range(3):
        m.request_started("a")
    assert value(m, "gateway_requests_in_flight", model="a") == 3
    m.request_finished("a", 200, 0.2, streamed=True)
    m.request_finished("a", 200, 0.3, streamed=False)
    m.request_finished("a", 503, 0.01, streamed=False)
    m.request_started("b")
    m.request_finished("b", 429, 0.01, streamed=True)
    assert value(m, "gateway_requests_total", model="a", code="200") == 2
    assert value(m, "gateway_requests_total", model="a", code="503") == 1
    assert value(m, "gateway_requests_total", model="b", code="429") == 1
    assert value(m, "gateway_requests_total", model="b", code="200") is None
    assert value(m, "gateway_requests_in_flight", model="a") == 0
    assert value(m, "gateway_requests_in_flight", model="b") == 0


def test_duration_separates_streaming_from_full_response_times():
    m = GatewayMetrics()
    m.request_started("a")
    m.request_finished("a", 200, 4.0, streamed=False)
    m.request_started("a")
    m.request_finished("a", 200, 1.5, streamed=True)
    assert value(m, "gateway_request_duration_seconds_count", model="a", stream="false") == 1
    assert value(m, "gateway_request_duration_seconds_sum", model="a", stream="false") == 4.0
    assert value(m, "gateway_request_duration_seconds_count", model="a", stream="true") == 1
    assert value(m, "gateway_request_duration_seconds_sum", model="a", stream="true") == 1.5
    # A non-streaming request never lands in the first-token histogram.
    assert not value(m, "gateway_time_to_first_token_seconds_count", model="a")


def test_first_token_inter_token_usage_trimmed():
    m = GatewayMetrics()
    m.first_token("a", 0.042)
    for gap in (0.01, 0.02, 0.03):
        m.inter_token("a", gap)
    m.usage("a", 120, 16)
    m.usage("a", 30, 0)
    m.trimmed("a", 4, 900)
    m.trimmed("a", 0, 0)
    assert value(m, "gateway_time_to_first_token_seconds_count", model="a") == 1
    assert value(m, "gateway_time_to_first_token_seconds_sum", model="a") == 0.042
    assert value(m, "gateway_time_to_first_token_seconds_bucket", model="a", le="0.05") == 1
    assert value(m, "gateway_time_to_first_token_seconds_bucket", model="a", le="0.025") == 0
    assert value(m, "gateway_inter_token_latency_seconds_count", model="a") == 3
    assert abs(value(m, "gateway_inter_token_latency_seconds_sum", model="a") - 0.06) < 1e-9
    assert value(m, "gateway_prompt_tokens_total", model="a") == 150
    assert value(m, "gateway_completion_tokens_total", model="a") == 16
    assert value(m, "gateway_trimmed_messages_total", model="a") == 4
    assert value(m, "gateway_trimmed_tokens_total", model="a") == 900


def test_buckets_span_milliseconds_to_minutes():
    for buckets, low, high in (
        (TTFT_BUCKETS, 0.01, 120.0),
        (ITL_BUCKETS, 0.001, 5.0),
        (DURATION_BUCKETS, 0.1, 1800.0),
    ):
        assert list(buckets) == sorted(set(buckets))
        assert buckets[0] <= low and buckets[-1] >= high
    m = GatewayMetrics()
    m.first_token("a", 200.0)  # a first token after minutes still lands in a finite bucket
    assert value(m, "gateway_time_to_first_token_seconds_bucket", model="a", le="300.0") == 1
    assert value(m, "gateway_time_to_first_token_seconds_bucket", model="a", le="120.0") == 0


def test_model_label_set_is_capped():
    m = GatewayMetrics(max_models=3)
    for i in range(10):
        m.request_started(f"m{i}")
        m.request_finished(f"m{i}", 404, 0.001, streamed=False)
    models = {dict(labels)["model"] for (name, labels) in samples(m) if name == "gateway_requests_total"}
    assert models == {"m0", "m1", "m2", OTHER_MODEL}
    assert value(m, "gateway_requests_total", model=OTHER_MODEL, code="404") == 7
    assert value(m, "gateway_requests_in_flight", model=OTHER_MODEL) == 0
