"""Made-up engines for the scorer's pure tests: an id, requests in flight and a scraped KV usage."""

from __future__ import annotations

from server.gateway.replicas.engine import Engine, EngineMetrics


def E(id: str, outstanding: int = 0, *, kv_usage: float | None = 0.0) -> Engine:
    engine = Engine("m", f"http://{id}")
    engine.outstanding = outstanding
    engine.metrics = EngineMetrics(kv_usage=kv_usage)
    return engine
