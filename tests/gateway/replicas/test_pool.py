"""The pool: served models by name, taking and giving back replicas; and the one Engine per replica
that the health checker and the scraper write and routing and the collector read."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.config import ServedModel
from server.gateway.errors import ModelNotFound
from server.gateway.replicas import adapters
from server.gateway.replicas.collector import EngineCollector
from server.gateway.replicas.health import HealthChecker
from server.gateway.replicas.pool import EnginePool
from server.gateway.replicas.scraper import EngineMetricsScraper, parse_engine_metrics
from server.gateway.settings import HealthCheck, Routing
from tests.gateway.replicas.test_scraper import VLLM_TEXT, scrape


def pool_of(**models: list[str]) -> EnginePool:
    return EnginePool.from_models(ServedModel(name, urls) for name, urls in models.items())


def test_acquire_counts_the_request_and_release_gives_it_back():
    model = pool_of(m=["http://a:1", "http://b:1"]).get("m")
    first, second = model.acquire(Routing()), model.acquire(Routing())
    assert first is not None and second is not None
    assert {first.id, second.id} == {"a:1", "b:1"}
    assert first.outstanding == second.outstanding == 1
    model.release(first)
    assert first.outstanding == 0
    assert model.acquire(Routing()) is first


def test_acquire_skips_unhealthy_and_excluded_replicas_and_says_when_none_is_left():
    model = pool_of(m=["http://a:1", "http://b:1"]).get("m")
    a, b = model.engines
    b.mark_down("refused")
    assert model.acquire(Routing()) is a
    assert model.acquire(Routing(), exclude=[a]) is None
    assert (a.outstanding, b.outstanding) == (1, 0)


def test_a_model_named_twice_is_one_model_with_more_replicas_and_unknown_models_are_refused():
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1"]), ServedModel("m", ["http://b:1/"])])
    assert [e.id for e in pool.get("m").engines] == ["a:1", "b:1"]
    assert [e.url for e in pool.engines()] == ["http://a:1", "http://b:1"]
    with pytest.raises(ModelNotFound):
        pool.get("other")


def test_the_card_is_an_engines_own_once_one_reported_it():
    model = pool_of(m=["http://a:1"]).get("m")
    assert model.card() == {"id": "m", "object": "model", "created": 0, "owned_by": "vllm", "max_model_len": None}
    model.engines[0].card = {"id": "m", "object": "model", "max_model_len": 4096}
    assert model.card()["max_model_len"] == 4096 and model.max_model_len == 4096


def test_ready_needs_a_healthy_replica_of_every_model():
    pool = pool_of(m=["http://a:1"], n=["http://b:1"])
    assert pool.ready()
    pool.get("n").engines[0].mark_down("refused")
    assert not pool.ready()
    assert not EnginePool([]).ready()


def fake_engine(health_status: int) -> httpx.MockTransport:
    """An engine serving model `m`, answering /health with `health_status`."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(health_status)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "object": "model", "max_model_len": 2048}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_TEXT)
        return httpx.Response(404)

    return httpx.MockTransport(answer)


async def test_what_the_checker_and_the_scraper_learn_is_on_the_engine_routing_takes():
    pool = pool_of(m=["http://a:1"])
    registry = CollectorRegistry()
    registry.register(EngineCollector(pool.engines()))
    (engine,) = pool.get("m").engines
    async with httpx.AsyncClient(transport=fake_engine(200)) as client:
        await HealthChecker(pool, client, HealthCheck()).check_all()
        await EngineMetricsScraper(pool.engines(), client=client).scrape_once(engine)
    assert pool.get("m").acquire(Routing()) is engine
    assert engine.healthy and engine.max_model_len == pool.get("m").max_model_len == 2048
    assert engine.metrics_up and engine.metrics == parse_engine_metrics(VLLM_TEXT)
    labels = frozenset({"model": "m", "engine": "a:1"}.items())
    assert scrape(registry)[("gateway_engine_kv_cache_capacity_tokens", labels)] == engine.metrics.kv_capacity_tokens


async def test_an_engine_the_checker_ejects_is_one_routing_passes_over():
    pool = pool_of(m=["http://a:1"])
    async with httpx.AsyncClient(transport=fake_engine(503)) as client:
        await HealthChecker(pool, client, HealthCheck()).check_all()
    assert pool.get("m").acquire(Routing()) is None and not pool.ready()
    assert pool.get("m").engines[0].last_error == "/health answered 503"


async def test_a_models_read_that_a_load_overtook_does_not_undo_the_load():
    pool = pool_of(m=["http://a:1"])
    (engine,) = pool.get("m").engines
    listed = [{"id": "m", "object": "model"}]
    loads_meanwhile = [("travel", "/loras/travel")]

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":  # the list leaves the engine, then a load lands here
            for name, path in loads_meanwhile:
                adapters.loaded(engine, name, path)
            loads_meanwhile.clear()
            return httpx.Response(200, json={"data": listed})
        return httpx.Response(200)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        checker = HealthChecker(pool, client, HealthCheck())
        await checker.refresh_card(engine)
        assert "travel" in engine.adapters and engine.card == listed[0]
        listed.append({"id": "other", "object": "model", "parent": "m"})
        await checker.refresh_card(engine)  # no load meanwhile: the engine's list is the truth
    assert list(engine.adapters) == ["other"]
