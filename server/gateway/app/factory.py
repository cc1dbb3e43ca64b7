"""The gateway, assembled in plain steps: `create_app(settings, models)` returns its FastAPI app.

    engines (pool, health checks, metrics scraping) ─┐
    history trimming (a request step)                ├─► GatewayApp (FastAPI) ─► ProxiedEndpoints
    metrics and access log (observability)          ─┘        ─► Proxy ─► transport ─► engine

Start-up runs one round of health checks before the first request and starts the engine
metrics scraper and, for precise prefix routing, the engines' KV-event subscribers; shutdown
stops them and closes the HTTP clients. Nothing is created at import.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from server.config import ServedModel
from server.gateway.app.admin import admin_router
from server.gateway.app.application import GatewayApp
from server.gateway.app.auth import load_admin_keys, load_api_keys, load_tenants
from server.gateway.app.hooks import apply_hooks
from server.gateway.app.proxied import ProxiedEndpoints
from server.gateway.app.responses import ResponsesApi
from server.gateway.app.state import GatewayState
from server.gateway.conversations.store import open_store
from server.gateway.flow.gate import build_gate
from server.gateway.observability.logs import log_request as default_log_request
from server.gateway.observability.loop_watch import LoopWatch
from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.observability.record import RequestReporter, TenantUsage
from server.gateway.proxy.proxy import Proxy
from server.gateway.proxy.transport import UpstreamTransport
from server.gateway.proxy.upstream import ClientUpstream, Upstream
from server.gateway.replicas.approximate import ApproximateIndex
from server.gateway.replicas.cache import CacheState
from server.gateway.replicas.collector import EngineCollector
from server.gateway.replicas.discovery import DnsLookup, EngineDiscovery
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.health import HealthChecker
from server.gateway.replicas.kv_events import KvEventsCollector, KvEventSubscriber
from server.gateway.replicas.pool import EnginePool
from server.gateway.replicas.precise import PreciseIndex
from server.gateway.replicas.scraper import EngineMetricsScraper
from server.gateway.replicas.tokenizer import EngineTokenizer
from server.gateway.settings import GatewaySettings
from server.gateway.tenants.directory import TenantDirectory
from server.gateway.tenants.isolation import load_cache_salts
from server.gateway.tenants.usage import UsageLedger
from server.gateway.trimming.step import HistoryTrimming
from server.gateway.trimming.target import make_lookup

log = logging.getLogger("gateway")


def new_http_client(settings: GatewaySettings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """The client for traffic to engines besides the proxied requests themselves (/tokenize)."""
    t = settings.timeouts
    return httpx.AsyncClient(
        transport=transport,
        headers={"accept-encoding": "identity"},
        timeout=httpx.Timeout(
            connect=t.connect, read=max(t.first_byte, t.idle) + 5.0, write=max(t.connect, 10.0), pool=t.first_byte
        ),
        trust_env=False,
        follow_redirects=False,
    )


def _ops_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """Health checks and scrapes get their own few connections: they never queue behind traffic.

    On the gateway's own transport (a pool of its own, up to 32 connections per engine), as
    traffic is: a probe costs a third to a half of the CPU it costs through httpcore's (220
    against 760 us for a /health, 320 against 680 for a /metrics, measured), paid for every engine
    every couple of seconds, under load and idle."""
    return httpx.AsyncClient(
        transport=UpstreamTransport(max_connections=32, keepalive_expiry=30.0),
        timeout=httpx.Timeout(settings.health.timeout, connect=settings.timeouts.connect),
        trust_env=False,
    )


def kv_event_endpoints(upstreams: EnginePool, models: Sequence[ServedModel]) -> dict[str, str]:
    """Engine id -> the ZMQ endpoint of its KV events, for the engines that publish them."""
    by_url = {url.rstrip("/"): endpoint for model in models for url, endpoint in model.kv_events.items()}
    return {engine.id: by_url[engine.url] for engine in upstreams.engines() if engine.url in by_url}


def create_app(
    settings: GatewaySettings,
    models: Sequence[ServedModel],
    *,
    http_client: httpx.AsyncClient | None = None,
    registry: CollectorRegistry | None = None,
    metrics: Any = None,
    log_request: Callable[..., None] | None = default_log_request,
    environ: Mapping[str, str] | None = None,
) -> GatewayApp:
    """The OpenAI-compatible gateway for `settings` in front of `models`' engines, as a FastAPI app
    (app.application); `settings.app_hooks` are called with it last (app.hooks)."""
    metrics = metrics if metrics is not None else GatewayMetrics(registry)
    owns_client = http_client is None
    upstream: Upstream
    if http_client is None:
        # `limits.max_connections` to each engine, an O(1) pool (server.gateway.proxy.transport).
        transport = UpstreamTransport(max_connections=settings.limits.max_connections, keepalive_expiry=30.0)
        client = new_http_client(settings, transport)
        upstream = transport
    else:
        client, upstream = http_client, ClientUpstream(http_client)
    routing = settings.routing
    tokenizer = EngineTokenizer(client, routing.tokenize_timeout)
    cache = CacheState(
        approximate=ApproximateIndex(ttl=routing.approximate_ttl),
        precise=PreciseIndex(speculative_ttl=routing.speculative_ttl),
        tokenize=tokenizer,
        block_chars=routing.block_chars,
    )
    upstreams = EnginePool.from_models(models, cache=cache)
    kv_events = KvEventSubscriber(
        cache.precise,
        kv_event_endpoints(upstreams, models)
        if routing.policy == "cache_aware" and routing.prefix_index == "precise"
        else {},
    )
    ops_client = _ops_client(settings)
    keys = load_api_keys(settings.auth, environ, base=settings.source.parent if settings.source else None)
    admin_keys = load_admin_keys(settings.auth, environ)
    tenants = load_tenants(settings, environ, admin_keys=admin_keys)
    if tenants is not None:
        keys = tenants.keys  # every model key is a tenant's: no authorization header reaches an engine
        _warn_unserved(tenants, models)
    ledger = UsageLedger() if tenants is not None else None

    health = HealthChecker(upstreams, ops_client, settings.health)
    scraper = EngineMetricsScraper(upstreams.engines(), client=ops_client, interval=settings.metrics_scrape_interval)
    metrics.registry.register(EngineCollector(upstreams.engines))

    def engine_left(engine: Engine) -> None:
        scraper.remove(engine)
        cache.approximate.forget(engine.id)

    async def engine_found(engine: Engine) -> None:
        await health.check(engine)
        scraper.add(engine)

    discovery = EngineDiscovery(
        upstreams,
        models,
        DnsLookup(settings.discovery.nameservers, timeout=settings.discovery.timeout),
        interval=settings.discovery.interval,
        join=engine_found,
        leave=engine_left,
    )
    metrics.registry.register(KvEventsCollector(cache.precise, {e.id: e.model for e in upstreams.engines()}))
    timeout = httpx.Timeout(settings.timeouts.first_byte, connect=settings.timeouts.connect)
    trimming = HistoryTrimming(lookup=make_lookup(upstreams, client, timeout), metrics=metrics)

    loop_watch = LoopWatch(metrics.loop_lag)  # how late this process's loop runs: a stall every stream feels

    async def startup() -> None:
        if tenants is not None:
            await tenants.start(settings.quota_store, environ, metrics.registry)  # quota_store: redis, host file
        await discovery.start()  # engines found by DNS join after their first health check
        await health.start()
        await scraper.start()
        await kv_events.start()
        await responses.start()  # the response store opens (refused with the reason if it cannot)
        await loop_watch.start()  # last: a start-up that fails leaves nothing of it running

    async def shutdown() -> None:
        try:
            await responses.aclose()
            await discovery.aclose()
            await kv_events.aclose()
            await scraper.aclose()
            await health.aclose()
            await cache.aclose()  # routing's background tokenizations (replicas.cache), before the client goes
            await tokenizer.aclose()
        finally:
            if tenants is not None:
                await tenants.aclose()
            await ops_client.aclose()
            if owns_client:
                await client.aclose()
            await loop_watch.aclose()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await startup()
        except Exception as exc:
            log.error("gateway start-up failed: %s", exc)
            raise
        try:
            yield
        finally:
            await shutdown()

    flow = build_gate(settings, models, metrics.registry)  # tenants' requests wait there when engines are full
    proxy = Proxy(settings=settings, upstream=upstream, metrics=metrics, forward_auth=not keys, flow=flow)
    state = GatewayState(
        upstreams=upstreams,
        registry=metrics.registry,
        proxy=proxy,
        health=health,
        keys=keys,
        protect_ops=settings.auth.protect_ops_endpoints,
    )
    proxied = ProxiedEndpoints(
        state=state,
        proxy=proxy,
        reporter=RequestReporter(
            metrics, log_request if settings.access_log else None, _tenant_usage(metrics, ledger) if ledger else None
        ),
        steps=[trimming],
        keys=keys,
        max_body_bytes=settings.limits.max_body_bytes,
        admin_keys=admin_keys,
        max_upload_bytes=settings.limits.max_upload_bytes,
        tenants=tenants,
        cache_salts=load_cache_salts(settings, environ),
    )
    store = open_store(
        settings.responses_store, environ=environ, base=settings.source.parent if settings.source else None
    )
    responses = ResponsesApi(proxied=proxied, store=store, config=settings.responses_store)
    app = GatewayApp(state=state, proxied=proxied, responses=responses, lifespan=lifespan)
    if ledger is not None:
        app.include_router(admin_router(admin_keys, ledger))
    apply_hooks(app, settings.app_hooks)
    return app


def _tenant_usage(metrics: Any, ledger: UsageLedger) -> TenantUsage:
    """Where a tenant's finished request is booked: the `gateway_tenant_*` counters and the ledger."""
    count = getattr(metrics, "tenant_usage", None)  # (a test's own metrics object may not count tenants)
    record = ledger.record

    def book(tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None:
        if count is not None:
            count(tenant, model, status, prompt, cached, completion)
        record(tenant, model, status, prompt, cached, completion)

    return book


def _warn_unserved(tenants: TenantDirectory, models: Sequence[ServedModel]) -> None:
    """Allow-listed names no engine serves as a base model: a typo, or a LoRA adapter loaded later."""
    served = {model.name for model in models}
    for tenant in tenants.tenants.values():
        unknown = sorted((tenant.allowed or frozenset()) - served)
        if unknown:
            log.warning("tenant %s: models %s are not served base models (LoRA adapters?)", tenant.name, unknown)
