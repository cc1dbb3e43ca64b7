"""The gateway application, assembled in plain steps: `create_app(settings)`.

    POST /v1/chat/completions, /v1/completions (raw ASGI, past FastAPI: GatewayApp)
        RequestContext (request id, last-resort 500) ─► Auth ─► Trimming ─► server.gateway.proxy.exchange
    everything else: FastAPI ─► RequestContext ─► Auth ─► routes
        GET /v1/models[/{id}]            the union of the engines' cards
        GET /health, /ready, /metrics    alive; routable; Prometheus

The lifespan starts the health checker (one round before the first request) and the engine
metrics scraper, and closes the HTTP clients. Nothing is created at import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.gateway.edge.auth import AuthMiddleware, load_api_keys
from server.gateway.edge.context import RequestContextMiddleware
from server.gateway.engines.scraper import EngineMetricsScraper, ScrapeTarget
from server.gateway.errors import GatewayError, InternalError, InvalidRequest, error_body, from_http_status
from server.gateway.engines.health import HealthChecker
from server.gateway.observability.logs import log_request as default_log_request
from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.proxy.exchange import PATHS, Proxy
from server.gateway.settings import GatewaySettings
from server.gateway.trimming.middleware import TrimmingMiddleware
from server.gateway.trimming.target import make_lookup
from server.gateway.proxy.transport import ClientUpstream, UpstreamTransport
from server.gateway.engines.pool import Upstreams, build_upstreams
from server.engine.profiles import Profile


@dataclass
class GatewayState:
    """What the routes share; `app.state.gateway`."""

    settings: GatewaySettings
    upstreams: Upstreams
    metrics: Any
    proxy: Proxy
    health: HealthChecker
    draining: bool = False  # set on shutdown: /ready answers 503 so balancers stop sending


def new_http_client(settings: GatewaySettings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """The client for traffic to engines besides the proxied requests themselves (/tokenize)."""
    t = settings.timeouts
    return httpx.AsyncClient(
        transport=transport, headers={"accept-encoding": "identity"},
        timeout=httpx.Timeout(connect=t.connect, read=max(t.first_byte, t.idle) + 5.0,
                              write=max(t.connect, 10.0), pool=t.first_byte),
        trust_env=False,
        follow_redirects=False,
    )


def _ops_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """Health checks and scrapes get their own few connections: they never queue behind traffic."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.health.timeout, connect=settings.timeouts.connect),
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=32, keepalive_expiry=30.0),
        trust_env=False,
    )


def _error_response(exc: GatewayError) -> Response:
    return Response(error_body(exc), status_code=exc.status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in exc.headers})


async def _handle_error(request: Request, exc: Exception) -> Response:
    """The one exception handler: every refusal becomes the OpenAI error envelope."""
    if isinstance(exc, GatewayError):
        return _error_response(exc)
    if isinstance(exc, StarletteHTTPException):
        return _error_response(from_http_status(exc.status_code, str(exc.detail)))
    if isinstance(exc, RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error_response(InvalidRequest(f"Invalid request: {first.get('msg', 'malformed')}.", param=param))
    return _error_response(InternalError("The gateway failed unexpectedly."))  # pragma: no cover


class GatewayApp(FastAPI):
    """FastAPI, except that the two generation endpoints skip it.

    POSTs to /v1/chat/completions and /v1/completions go through their own short chain
    (request id, auth, trimming, proxy) instead of Starlette's application, error and routing
    layers, which would otherwise add ~100 us to every request and a wrapper to every streamed
    chunk's `send`. The same endpoints are registered as FastAPI routes too, so other methods
    get a 405 and the app describes itself truthfully.
    """

    hot_paths: dict[str, Any] = {}
    hot_chain: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.hot_paths:
            await self.hot_chain(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class _Dispatch:
    """The end of the hot chain: the proxy endpoint for the path."""

    def __init__(self, routes: dict[str, Any]) -> None:
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.routes[scope["path"]](scope, receive, send)


def create_app(settings: GatewaySettings, *, http_client: httpx.AsyncClient | None = None,
               registry: CollectorRegistry | None = None, metrics: Any = None,
               profiles: dict[str, Profile] | None = None,
               log_request: Callable[..., None] | None = default_log_request,
               environ: dict[str, str] | None = None) -> FastAPI:
    """The OpenAI-compatible gateway for `settings` (see the module doc for what it serves)."""
    profiles = settings.load_profiles() if profiles is None else profiles
    upstreams = build_upstreams(settings.resolve_models(profiles))
    metrics = metrics if metrics is not None else GatewayMetrics(registry)
    engines = list(upstreams.engines())
    owns_client = http_client is None
    if http_client is None:
        # `limits.max_connections` to each engine, an O(1) pool (server.gateway.proxy.transport).
        transport: httpx.AsyncBaseTransport = UpstreamTransport(
            max_connections=settings.limits.max_connections, keepalive_expiry=30.0)
        client = new_http_client(settings, transport)
        upstream: Any = transport
    else:
        client, upstream = http_client, ClientUpstream(http_client)
    ops_client = _ops_client(settings)
    keys = load_api_keys(settings.auth, environ, base=settings.source.parent if settings.source else None)

    proxy = Proxy(settings=settings, upstreams=upstreams, upstream=upstream, metrics=metrics,
                  log_request=log_request)
    proxy.forward_auth = not keys  # without keys of its own, the gateway passes the client's on
    health = HealthChecker(upstreams, ops_client, settings.health)
    scraper = EngineMetricsScraper(
        [ScrapeTarget(model=e.model, engine=e.id, url=e.url,
                      planned_kv_tokens=upstreams.models[e.model].planned_kv_tokens) for e in engines],
        client=ops_client, registry=metrics.registry, interval=settings.metrics_scrape_interval,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await health.start()
            await scraper.start()
            yield
        finally:
            await scraper.aclose()
            await health.aclose()
            await ops_client.aclose()
            if owns_client:
                await client.aclose()

    app = GatewayApp(title="OpenAI-compatible gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                     openapi_url=None)
    state = app.state.gateway = GatewayState(settings=settings, upstreams=upstreams, metrics=metrics,
                                             proxy=proxy, health=health)

    chat, completions = proxy.endpoint("chat"), proxy.endpoint("completions")
    app.add_route(PATHS["chat"], chat, methods=["POST"])
    app.add_route(PATHS["completions"], completions, methods=["POST"])

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [pool.card() for pool in upstreams.models.values()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        return JSONResponse(upstreams.get(model).card())

    @app.get("/health")
    async def alive() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        models = {name: {"healthy": pool.healthy_count, "engines": len(pool.engines)}
                  for name, pool in upstreams.models.items()}
        ok = upstreams.ready() and not state.draining
        body = {"ready": ok, "draining": state.draining, "models": models}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for kind in (GatewayError, StarletteHTTPException, RequestValidationError):
        app.add_exception_handler(kind, _handle_error)

    # Every other request: FastAPI with request ids and auth (added innermost first).
    app.add_middleware(AuthMiddleware, keys=keys, protect_ops=settings.auth.protect_ops_endpoints)
    app.add_middleware(RequestContextMiddleware)
    # The generation endpoints: the same request ids and auth, then history trimming, then the proxy.
    routes = {PATHS["chat"]: chat, PATHS["completions"]: completions}
    timeout = httpx.Timeout(settings.timeouts.first_byte, connect=settings.timeouts.connect)
    trimming = TrimmingMiddleware(_Dispatch(routes), lookup=make_lookup(upstreams, client, settings.routing, timeout),
                                  metrics=metrics, max_body_bytes=settings.limits.max_body_bytes)
    app.hot_paths = routes
    app.hot_chain = RequestContextMiddleware(
        AuthMiddleware(trimming, keys=keys, protect_ops=settings.auth.protect_ops_endpoints))
    return app
