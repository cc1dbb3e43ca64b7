"""Which model pool a request goes to, and which replicas may answer it.

- `model` names a served model: its pool, any healthy replica.
- `model` names a LoRA adapter: the pool of its base model, only the replicas that serve the
  adapter (replicas.adapters).
- Stored responses (Responses API) are the gateway's own (server.gateway.conversations, served by
  app.responses): the engines are sent stateless requests (`store: false`, the whole input), so a
  continuation goes wherever routing sends it, like any other request. The retrieve and cancel
  entries of request.endpoints are answered by app.responses before they reach the proxy; one
  that does reach it (no such route installed) is 404 here, since no engine keeps responses.
"""

from __future__ import annotations

from server.gateway.errors import ModelNotFound, ResponseNotFound
from server.gateway.replicas import adapters
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import EnginePool, ModelPool
from server.gateway.request.request import GatewayRequest


def find_pool(pools: EnginePool, model: str) -> tuple[ModelPool, str | None]:
    """The pool for `model`, and the adapter it names (None for a base model)."""
    pool = pools.models.get(model)
    if pool is not None:
        return pool, None
    pool = adapters.pool_serving(pools, model)
    if pool is None:
        raise ModelNotFound(model, [*pools.models, *adapters.adapter_names(pools)])
    return pool, model


def served(pools: EnginePool, model: str | None) -> bool:
    """`model` names a served model or a served LoRA adapter (a metrics label may carry it)."""
    return bool(model) and (model in pools.models or adapters.pool_serving(pools, model or "") is not None)


def resolve(pools: EnginePool, request: GatewayRequest) -> ModelPool:
    """The pool `request` goes to; sets `request.adapter` when `model` names a LoRA adapter."""
    if request.endpoint.model_from == "response_id":
        raise ResponseNotFound(
            f"Response with id '{request.response_id}' not found: stored responses are the gateway's "
            "(responses_store), not the engines'.",
            param="response_id",
        )
    pool, request.adapter = find_pool(pools, request.model)
    return pool


def excluded(request: GatewayRequest, pool: ModelPool) -> list[Engine]:
    """The replicas of `pool` that must not answer `request` (those not serving its adapter)."""
    if request.pin is not None:
        return [engine for engine in pool.engines if engine is not request.pin]
    if request.adapter is not None:
        return adapters.lacking(pool.engines, request.adapter)
    return []


def body_for(request: GatewayRequest, engine: Engine) -> bytes:
    """The bytes `engine` gets (the same for every replica)."""
    return request.raw
