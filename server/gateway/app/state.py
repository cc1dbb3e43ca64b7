"""What the gateway's routes and its server share about the running gateway: the app's `state`.

FastAPI keeps an application's shared objects on `app.state`; the gateway's is this one, with
its attributes declared so that routes (`request.app.state`) and the type checker agree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from starlette.datastructures import State

from server.gateway.proxy.proxy import Proxy
from server.gateway.replicas.health import HealthChecker
from server.gateway.replicas.pool import EnginePool


class GatewayState(State):
    """The running gateway's shared objects (see the module doc)."""

    upstreams: EnginePool
    registry: CollectorRegistry
    proxy: Proxy
    health: HealthChecker
    keys: list[bytes]  # the API keys model traffic needs (none: open)
    protect_ops: bool  # /health, /ready and /metrics need the key too
    draining: bool  # set on shutdown: /ready answers 503 so balancers stop sending

    def __init__(
        self,
        *,
        upstreams: EnginePool,
        registry: CollectorRegistry,
        proxy: Proxy,
        health: HealthChecker,
        keys: list[bytes] | None = None,
        protect_ops: bool = False,
    ) -> None:
        super().__init__()
        self.upstreams = upstreams
        self.registry = registry
        self.proxy = proxy
        self.health = health
        self.keys = keys or []
        self.protect_ops = protect_ops
        self.draining = False
