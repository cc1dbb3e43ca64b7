"""Health ejection and recovery, session and prefix affinity and its load bound, against real stand-ins."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import wait_for


def post(gw, body, **headers):
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response


def test_unhealthy_engine_gets_no_traffic_until_it_recovers(engines, gateway):
    sick, well = engines(2)
    gw = gateway(fast_settings({"standin": [sick.url, well.url]}))
    ready = httpx.get(f"{gw.url}/ready").json()
    assert ready["ready"] and ready["models"]["standin"] == {"healthy": 2, "engines": 2}

    sick.faults(health_status=503)
    wait_for(lambda: gw.healthy("standin") == {1})  # in every worker: each checks the engines itself
    for _ in range(10):
        post(gw, chat_body())
    assert sick.stats()["started"] == 0 and well.stats()["finished"] == 10

    sick.faults()  # recovers
    wait_for(lambda: gw.healthy("standin") == {2})
    for _ in range(10):
        post(gw, chat_body())
    assert sick.stats()["started"] > 0


def test_no_healthy_engine_answers_503_and_ready_says_so(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    engine.faults(health_status=500)
    wait_for(lambda: gw.healthy("standin") == {0})
    ready = httpx.get(f"{gw.url}/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert httpx.get(f"{gw.url}/health").status_code == 200  # alive, just not routable
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_engine"
    assert engine.stats()["started"] == 0


@pytest.mark.one_process("runs the gateway's health checker by hand, one check at a time")
def test_ejection_needs_consecutive_failures_and_one_success_restores(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, health={"interval": 60, "unhealthy_after": 3}))
    checker, target = gw.state.health, gw.engine("standin")
    engine.faults(health_status=503)
    for expected in (True, True, False):
        httpx.get(f"{gw.url}/health")  # any request, to let the gateway's loop run
        _run(checker.check(target), gw)
        assert target.healthy is expected
    engine.faults()
    _run(checker.check(target), gw)
    assert target.healthy


def _run(coro, gw):
    """Run a coroutine on the gateway's own event loop (its uvicorn thread) and wait for it."""
    import asyncio

    loop = gw.state.health._task.get_loop()
    asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)


def test_session_affinity_keeps_a_session_on_one_engine(engines, gateway):
    a, b, c = engines(3)
    gw = gateway(fast_settings({"standin": [a.url, b.url, c.url]}))
    for _ in range(12):
        post(gw, chat_body(), **{"x-session-id": "alice"})
    counts = sorted(e.stats()["started"] for e in (a, b, c))
    assert counts == [0, 0, 12]
    for i in range(12):  # the `user` field works the same way
        post(gw, chat_body(f"question {i}", user="bob"))
    counts = sorted(e.stats()["started"] for e in (a, b, c))
    assert counts[-1] >= 12 and sum(counts) == 24
    assert sum(1 for n in counts if n) <= 2


def test_different_sessions_spread_over_the_engines(engines, gateway):
    a, b = engines(2)
    gw = gateway(fast_settings({"standin": [a.url, b.url]}))
    for i in range(30):
        post(gw, chat_body(), **{"x-session-id": f"user-{i}"})
    assert a.stats()["started"] >= 5 and b.stats()["started"] >= 5


def test_prefix_affinity_sends_a_shared_long_prefix_to_one_engine(engines, gateway):
    a, b = engines(2)
    gw = gateway(fast_settings({"standin": [a.url, b.url]}, routing={"prefix_chars": 300, "prefix_min_chars": 200}))
    system = {"role": "system", "content": "You are a travel agent. " * 20}
    for i in range(10):
        post(gw, {"model": "standin", "messages": [system, {"role": "user", "content": f"trip {i}"}]})
    assert sorted([a.stats()["started"], b.stats()["started"]]) == [0, 10]
    for i in range(10):  # short prompts are balanced by load instead
        post(gw, chat_body(f"hi {i}"))
    assert min(a.stats()["started"], b.stats()["started"]) >= 1


def test_affinity_yields_to_load_beyond_max_imbalance(engines, gateway):
    # The engines hold every request until released: all 8 are in flight when the split is read,
    # however late a busy machine starts them.
    a, b = engines(2, ttft_ms=1, itl_ms=1, tokens=2)
    for engine in (a, b):
        engine.faults(hold=True)
    gw = gateway(fast_settings({"standin": [a.url, b.url]}, routing={"max_imbalance": 2}, timeouts={"first_byte": 60}))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, gw, chat_body(), **{"x-session-id": "hot"}) for _ in range(8)]
        wait_for(lambda: a.stats()["held"] + b.stats()["held"] == 8)
        running = sorted([a.stats()["running"], b.stats()["running"]])
        for engine in (a, b):
            httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        for future in futures:
            future.result()
    # Unbounded affinity would put all 8 on one engine; the bound keeps them within 2 of each other
    # in each worker (each counts the requests it sent), so within 2 per worker in all.
    assert running[1] - running[0] <= 2 * gw.workers
    assert running[0] >= (8 - 2 * gw.workers) // 2
