"""The gateway's own GET endpoints, as FastAPI routes: the model list, liveness, readiness, metrics.

GET /v1/models               the union of the engines' model cards: base models, then LoRA adapters
GET /v1/models/{model}       one card (a model or an adapter), or 404 model_not_found
GET /health                  the gateway process is alive
GET /ready                   every model has a healthy engine and the gateway is not draining
GET /metrics                 Prometheus text (the gateway's and the engines' figures)

Each answers HEAD as well. The model list needs the API key (when the gateway has keys);
/health, /ready and /metrics need it only with `auth.protect_ops_endpoints`, so probes and
Prometheus need none (`api_key`, a dependency of the router). With tenants the list holds
only the models the caller's tenant may use, and another model's card is 403 model_not_allowed.
The response models describe the answers in /openapi.json; the cards themselves are the engines'
own, passed on as they came.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from server.gateway.app.auth import check_api_key, identify_tenant
from server.gateway.app.state import GatewayState
from server.gateway.errors import ModelNotFound, RouteNotFound
from server.gateway.jsonio import dumps
from server.gateway.replicas import adapters
from server.gateway.tenants.directory import TenantRuntime
from server.gateway.tenants.errors import ModelNotAllowed

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # no API key unless protect_ops_endpoints


def gateway_state(request: Request) -> GatewayState:
    """The running gateway's shared state (the app's `state`)."""
    state: GatewayState = request.app.state
    return state


State = Annotated[GatewayState, Depends(gateway_state)]


def api_key(request: Request, state: State) -> None:
    """The API key check of the gateway's own routes (see the module doc)."""
    if state.protect_ops or request.url.path not in OPEN_PATHS:
        check_api_key(request.scope["headers"], state.keys)


def caller(request: Request) -> TenantRuntime | None:
    """The caller's tenant when the gateway has tenants (the model list shows only its models)."""
    tenants = getattr(getattr(request.app, "proxied", None), "tenants", None)
    return identify_tenant(request.scope["headers"], tenants) if tenants is not None else None


Caller = Annotated[TenantRuntime | None, Depends(caller)]
router = APIRouter(dependencies=[Depends(api_key)], tags=["gateway"])
Handler = Callable[..., Awaitable[Response]]


class ModelCard(BaseModel):
    """One served model or LoRA adapter, as its engine describes it (vLLM's card, more fields allowed)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "vllm"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class ModelReadiness(BaseModel):
    healthy: int
    engines: int


class Readiness(BaseModel):
    ready: bool
    draining: bool
    models: dict[str, ModelReadiness]


def _get(path: str, **options: Any) -> Callable[[Handler], Handler]:
    """Register a GET route (described in /openapi.json) that answers HEAD too (not described twice)."""

    def register(handler: Handler) -> Handler:
        router.add_api_route(path, handler, methods=["GET"], **options)
        router.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False, **options)
        return handler

    return register


def _json(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


@_get("/v1/models", response_model=ModelList, summary="List the served models")
async def list_models(state: State, tenant: Caller) -> Response:
    cards = [pool.card() for pool in state.upstreams.models.values()]
    cards += adapters.all_adapter_cards(state.upstreams)
    if tenant is not None and tenant.allowed is not None:
        cards = [card for card in cards if tenant.may_use(str(card.get("id")))]
    return _json({"object": "list", "data": cards})


@_get(
    "/v1/models/{model:path}",
    response_model=ModelCard,
    summary="One served model or LoRA adapter",
    responses={
        403: {"description": "The caller's tenant may not use it (model_not_allowed)"},
        404: {"description": "No such model (model_not_found)"},
    },
)
async def get_model(model: str, state: State, tenant: Caller) -> Response:
    if not model:
        raise RouteNotFound("Not found.")
    if tenant is not None and not tenant.may_use(model):
        raise ModelNotAllowed(tenant.name, model)
    pools = state.upstreams
    if model in pools.models:
        return _json(pools.get(model).card())
    for card in adapters.all_adapter_cards(pools):
        if card.get("id") == model:
            return _json(card)
    raise ModelNotFound(model, [*pools.models, *adapters.adapter_names(pools)])


@_get("/health", response_model=Health, summary="The gateway process is alive")
async def alive() -> Response:
    return _json({"status": "ok"})


@_get(
    "/ready",
    response_model=Readiness,
    summary="Every model has a healthy engine and the gateway is not draining",
    responses={503: {"description": "Not ready (a model without a healthy engine, or draining)", "model": Readiness}},
)
async def ready(state: State) -> Response:
    models = {
        name: {"healthy": pool.healthy_count, "engines": len(pool.engines)}
        for name, pool in state.upstreams.models.items()
    }
    ok = state.upstreams.ready() and not state.draining
    return _json({"ready": ok, "draining": state.draining, "models": models}, 200 if ok else 503)


@_get(
    "/metrics",
    summary="Prometheus metrics: the gateway's own and its engines'",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}},
)
async def prometheus(state: State) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
