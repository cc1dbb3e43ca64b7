"""A FlowCollector with every `gateway_flow_*` series populated, for tests that check what the
dashboards and alerts query against what the gateway exports (tests/metrics)."""

from __future__ import annotations

from server.gateway.flow.control import FlowControl, ModelQueue
from server.gateway.flow.metrics import FlowCollector
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import ModelPool
from server.gateway.settings import Flow


def populated_flow_collector(engine: Engine, tenant: str = "planner") -> FlowCollector:
    control = FlowControl(Flow())
    control.models[engine.model] = ModelQueue(ModelPool(engine.model, [engine]))
    control.tally.admitted(engine.model, "batch", tenant, 0.5)
    control.tally.shed(engine.model, "batch", tenant, "queue_full", 0.0)
    control.tally.served(engine.model, tenant, 10)
    return FlowCollector(control, [tenant])
