"""`GatewayMetrics.inter_token` (and the relay's `inter_token_sink`) keeps values in a plain list and
folds them into the histogram later: what Prometheus sees must be exactly what `Histogram.observe`
for each value would have made."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.gateway.observability.metrics import ITL_BUCKETS, GatewayMetrics


def itl_samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        if family.name == "gateway_inter_token_latency_seconds":
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    out[sample.name, sample.labels.get("le", "")] = sample.value
    return out


def reference(values: list[float]) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    histogram = Histogram("gateway_inter_token_latency_seconds", "ref", ["model"], buckets=ITL_BUCKETS,
                          registry=registry)  # fmt: skip
    for value in values:
        histogram.labels("m").observe(value)
    return itl_samples(registry)


# Values on the bucket bounds too: `le` means "at most", so 0.01 belongs to the 0.01 bucket.
EDGES = [0.0, 0.001, 0.0010001, 0.01, 0.0099999, 10.0, 10.5, 1e9, *ITL_BUCKETS]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_collection_sees_every_value_as_observe_would_have_counted_it(seed):
    rng = random.Random(seed)
    values = EDGES + [rng.expovariate(1 / 0.02) for _ in range(500)]
    metrics = GatewayMetrics(CollectorRegistry())
    for value in values:
        metrics.inter_token("m", value)
    got = itl_samples(metrics.registry)  # nothing finished: the collection itself folds them in
    want = reference(values)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_a_finished_request_folds_its_model_in_once():
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.request_started("m")
    for value in (0.004, 0.012, 0.012):
        metrics.inter_token("m", value)
    metrics.request_finished("m", 200, 0.1, True)
    child = metrics._series("m").itl
    assert sum(bucket.get() for bucket in child._buckets) == 3
    assert child._sum.get() == pytest.approx(0.028)
    text = generate_latest(metrics.registry).decode()  # a collection adds nothing more
    assert 'gateway_inter_token_latency_seconds_count{model="m"} 3.0' in text
    assert 'gateway_inter_token_latency_seconds_bucket{le="0.015",model="m"} 3.0' in text
    assert 'gateway_inter_token_latency_seconds_bucket{le="0.01",model="m"} 1.0' in text


def test_the_relays_sink_keeps_working_across_folds():
    """A relay holds the sink for its whole stream: values it adds after a fold (another request of
    the model finished, or a scrape) must still be counted, each exactly once."""
    metrics = GatewayMetrics(CollectorRegistry())
    sink = metrics.inter_token_sink("m")
    first, second = [0.002, 0.01, 0.5], [0.0009, 12.0]
    for value in first:
        sink(value)
    metrics.request_started("m")
    metrics.request_finished("m", 200, 0.1, True)  # folds `first`
    for value in second:
        sink(value)
    got = itl_samples(metrics.registry)  # folds `second`
    want = reference(first + second)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert itl_samples(metrics.registry) == got  # nothing is counted twice


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_streams_folded_one_by_one_count_as_observe_would(seed):
    """Each finished stream folds its own few latencies, often all in a bucket or two and far from
    the first one (the fold starts at the smallest value's bucket and stops once all are counted)."""
    rng = random.Random(seed)
    metrics = GatewayMetrics(CollectorRegistry())
    everything: list[float] = []
    for _ in range(40):
        low = rng.choice([0.0, *ITL_BUCKETS])  # a stream's latencies sit around one bound or another
        stream = [
            rng.choice([low, low * 1.0001, low * 0.9999, low + rng.random() * 0.01]) for _ in range(rng.randint(1, 8))
        ]
        metrics.request_started("m")
        for value in stream:
            metrics.inter_token("m", value)
        metrics.request_finished("m", 200, 0.1, True)
        everything += stream
    got = itl_samples(metrics.registry)
    want = reference(everything)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
