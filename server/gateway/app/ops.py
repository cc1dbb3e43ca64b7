"""The gateway's own GET endpoints: the model list, liveness, readiness and Prometheus metrics.

GET /v1/models               the union of the engines' model cards: base models, then LoRA adapters
GET /v1/models/{id}          one card (a model or an adapter), or 404 model_not_found
GET /health                  the gateway process is alive
GET /ready                   every model has a healthy engine and the gateway is not draining
GET /metrics                 Prometheus text (the gateway's and the engines' figures)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from server.gateway.errors import ModelNotFound, RouteNotFound
from server.gateway.jsonio import dumps
from server.gateway.replicas import adapters
from server.gateway.replicas.pool import EnginePool

if TYPE_CHECKING:
    from server.gateway.proxy.proxy import Proxy
    from server.gateway.replicas.health import HealthChecker

JSON = b"application/json"
MODELS_PREFIX = "/v1/models/"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # no API key unless protect_ops_endpoints


@dataclass
class GatewayState:
    """What the ops endpoints and the server share about the running gateway."""

    upstreams: EnginePool
    registry: CollectorRegistry
    proxy: Proxy
    health: HealthChecker
    draining: bool = False  # set on shutdown: /ready answers 503 so balancers stop sending


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_type: bytes = JSON


Handler = Callable[[GatewayState, str], Awaitable[Answer]]


async def list_models(state: GatewayState, path: str) -> Answer:
    cards = [pool.card() for pool in state.upstreams.models.values()]
    cards += adapters.all_adapter_cards(state.upstreams)
    return Answer(200, dumps({"object": "list", "data": cards}))


async def get_model(state: GatewayState, path: str) -> Answer:
    model = path.removeprefix(MODELS_PREFIX)
    if not model:
        raise RouteNotFound("Not found.")
    pools = state.upstreams
    if model in pools.models:
        return Answer(200, dumps(pools.get(model).card()))
    for card in adapters.all_adapter_cards(pools):
        if card.get("id") == model:
            return Answer(200, dumps(card))
    raise ModelNotFound(model, [*pools.models, *adapters.adapter_names(pools)])


async def alive(state: GatewayState, path: str) -> Answer:
    return Answer(200, dumps({"status": "ok"}))


async def ready(state: GatewayState, path: str) -> Answer:
    models: dict[str, Any] = {
        name: {"healthy": pool.healthy_count, "engines": len(pool.engines)}
        for name, pool in state.upstreams.models.items()
    }
    ok = state.upstreams.ready() and not state.draining
    body = {"ready": ok, "draining": state.draining, "models": models}
    return Answer(200 if ok else 503, dumps(body))


async def prometheus(state: GatewayState, path: str) -> Answer:
    return Answer(200, generate_latest(state.registry), CONTENT_TYPE_LATEST.encode())


ROUTES: dict[str, Handler] = {"/v1/models": list_models, "/health": alive, "/ready": ready, "/metrics": prometheus}


def find_route(path: str) -> Handler | None:
    """The handler of a GET path, or None."""
    handler = ROUTES.get(path)
    if handler is None and path.startswith(MODELS_PREFIX):
        return get_model
    return handler
