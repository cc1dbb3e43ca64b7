"""Which model pool a request goes to, and which replica must answer it when only one can.

- `model` names a served model: its pool, any healthy replica.
- `model` names a LoRA adapter: the pool of its base model, only the replicas that serve the
  adapter (replicas.adapters).
- Stored responses (Responses API): vLLM keeps them in the memory of the engine that made them,
  so a `previous_response_id`, a retrieve and a cancel must reach that engine. The gateway keeps
  no table for this. It chooses every response id itself (`request_id` in the body of a
  Responses create, which vLLM uses as the response's id) so that the id names the engine:

      resp_<engine token>-<random hex>      token: 8 hex digits of blake2b(engine URL)

  Any gateway in front of the same engines reads the same token the same way (after a restart,
  or with several gateway replicas), and nothing grows with the number of responses. An id whose
  token matches no engine, or whose engine is down, is answered 404 in the envelope: the
  response lived in that engine's memory. (An engine that restarted has lost its responses; it
  answers 404 itself.) A `request_id` sent by the client is replaced.
"""

from __future__ import annotations

import hashlib
import uuid

from server.gateway.errors import ModelNotFound, ResponseNotFound
from server.gateway.jsonio import dumps
from server.gateway.replicas import adapters
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import EnginePool, ModelPool
from server.gateway.request.checks import wrong_type
from server.gateway.request.request import GatewayRequest

PREFIX = "resp_"
TOKEN_DIGITS = 8


def engine_token(engine: Engine) -> str:
    """The 8 hex digits that stand for `engine` in the response ids it stores."""
    return hashlib.blake2b(engine.url.encode(), digest_size=TOKEN_DIGITS // 2).hexdigest()


def new_response_id(engine: Engine) -> str:
    return f"{PREFIX}{engine_token(engine)}-{uuid.uuid4().hex}"


def token_of(response_id: str) -> str | None:
    """The engine token of a response id the gateway made, or None."""
    end = len(PREFIX) + TOKEN_DIGITS
    if response_id.startswith(PREFIX) and response_id[end : end + 1] == "-":
        return response_id[len(PREFIX) : end]
    return None


def stored_on(pools: EnginePool, response_id: str, param: str) -> Engine:
    """The engine that stored `response_id`; ResponseNotFound when none of ours did."""
    token = token_of(response_id)
    if token is not None:
        for engine in pools.engines():
            if engine_token(engine) == token:
                return engine
    raise ResponseNotFound(
        f"Response with id '{response_id}' not found: no engine behind this gateway stored it.", param=param
    )


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
    """The pool `request` goes to; sets `request.pin`, `.adapter` (and `.model` for a stored response)."""
    endpoint = request.endpoint
    if endpoint.model_from == "response_id":
        engine = stored_on(pools, request.response_id or "", "response_id")
        request.model, request.pin = engine.model, engine
        return pools.get(engine.model)
    pool, request.adapter = find_pool(pools, request.model)
    if endpoint.stores_responses:
        previous = request.body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise wrong_type("previous_response_id", "a string", previous)
            engine = stored_on(pools, previous, "previous_response_id")
            if engine not in pool.engines:
                raise ResponseNotFound(
                    f"Response with id '{previous}' not found: it was stored by an engine "
                    f"of model `{engine.model}`, not `{pool.name}`.",
                    param="previous_response_id",
                )
            request.pin = engine
    return pool


def excluded(request: GatewayRequest, pool: ModelPool) -> list[Engine]:
    """The replicas of `pool` that must not answer `request` (not the pinned one; not serving its adapter)."""
    if request.pin is not None:
        return [engine for engine in pool.engines if engine is not request.pin]
    if request.adapter is not None:
        return adapters.lacking(pool.engines, request.adapter)
    return []


def body_for(request: GatewayRequest, engine: Engine) -> bytes:
    """The bytes `engine` gets: a Responses create carries a response id naming `engine`."""
    if not request.endpoint.stores_responses:
        return request.raw
    return dumps(dict(request.body, request_id=new_response_id(engine)))
