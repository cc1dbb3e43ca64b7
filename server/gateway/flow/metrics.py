"""The gate's figures for Prometheus, read from the FlowControl at each scrape (no I/O, nothing on
the request path): `gateway_flow_*`. Labels: model, class, tenant (configured tenants only),
engine; so the series stay bounded. With `--workers N` each worker reports its own gate.

    gateway_flow_queued{model,class,tenant}                 requests waiting now
    gateway_flow_in_flight{model} / gateway_flow_capacity{model}   admitted now / room (this process)
    gateway_flow_engine_saturation{model,engine}           in flight on the engine / max-num-seqs
    gateway_flow_virtual_tokens{tenant}                    each tenant's virtual counter
    gateway_flow_admitted_total{model,class,tenant,queued}
    gateway_flow_shed_total{model,class,tenant,reason}     queue_full, queue_timeout, displaced, client_left
    gateway_flow_wait_seconds{model,class,tenant}          histogram: time at the gate
    gateway_flow_served_tokens_total{model,tenant}         uncached prompt + output tokens, from usage
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from server.gateway.flow.classes import CLASSES
from server.gateway.flow.control import FlowControl
from server.gateway.flow.saturation import saturation
from server.gateway.flow.tally import WAIT_BUCKETS


class FlowCollector(Collector):
    """Yields the `gateway_flow_*` families from `control` as it is now."""

    def __init__(self, control: FlowControl, tenants: list[str]) -> None:
        self.control = control
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        control = self.control
        tally = control.tally
        queued = GaugeMetricFamily(
            "gateway_flow_queued", "Requests waiting at the gateway's gate.", labels=["model", "class", "tenant"]
        )
        inflight = GaugeMetricFamily(
            "gateway_flow_in_flight", "Requests the gate admitted, not yet over.", labels=["model"]
        )
        room = GaugeMetricFamily(
            "gateway_flow_capacity", "Requests the gate admits at once (this process's share).", labels=["model"]
        )
        sat = GaugeMetricFamily(
            "gateway_flow_engine_saturation",
            "Requests in flight on the engine over its max-num-seqs, as the gateway counts them.",
            labels=["model", "engine"],
        )
        for model, queue in control.models.items():
            inflight.add_metric([model], queue.inflight)
            room.add_metric([model], control.capacity(queue.pool))
            for klass in CLASSES:  # every configured tenant in every class: 0 rather than no series
                waiting = queue.queued[klass]
                for tenant in self.tenants:
                    queued.add_metric([model, klass, tenant], len(waiting.get(tenant, ())))
            for engine in queue.pool.engines:
                sat.add_metric([model, engine.id], saturation(engine, control.max_num_seqs(model)))
        yield queued
        yield inflight
        yield room
        yield sat
        counters = GaugeMetricFamily(
            "gateway_flow_virtual_tokens", "Each tenant's virtual token counter (fair share).", labels=["tenant"]
        )
        for tenant in self.tenants:
            counters.add_metric([tenant], control.counters.get(tenant))
        yield counters
        admitted = CounterMetricFamily(
            "gateway_flow_admitted", "Requests the gate let through.", labels=["model", "class", "tenant", "queued"]
        )
        for labels, value in tally.admitted_total.items():
            admitted.add_metric(list(labels), value)
        yield admitted
        shed = CounterMetricFamily(
            "gateway_flow_shed",
            "Requests refused or dropped at the gate.",
            labels=["model", "class", "tenant", "reason"],
        )
        for labels, value in tally.shed_total.items():
            shed.add_metric(list(labels), value)
        yield shed
        served = CounterMetricFamily(
            "gateway_flow_served_tokens",
            "Tokens the engines worked for each tenant: uncached prompt plus output, from usage.",
            labels=["model", "tenant"],
        )
        for pair, tokens in tally.served_tokens.items():
            served.add_metric(list(pair), tokens)
        yield served
        waits = HistogramMetricFamily(
            "gateway_flow_wait_seconds", "Time requests waited at the gate.", labels=["model", "class", "tenant"]
        )
        for triple, histogram in tally.wait_histograms().items():
            cumulative, buckets = 0, []
            for bound, count in zip((*WAIT_BUCKETS, float("inf")), histogram.counts, strict=True):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            waits.add_metric(list(triple), buckets, histogram.sum)
        yield waits
