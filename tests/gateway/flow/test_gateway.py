"""The flow gate through a real gateway and stand-in engines over sockets: it holds only when the
engines are full (the gateway's own count against max-num-seqs), admits by class as room appears,
refuses past its bounds with 429 and Retry-After in the OpenAI envelope, drops a client that left
while queued before anything reaches the engine, sets vLLM's `priority`, and reports it all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import wait_for

KEYS = {"planner": "sk-planner", "articles": "sk-articles", "reports": "sk-reports"}
ONE_QUEUE = pytest.mark.one_process("the queue is each worker's own (flow.control); test_workers has two")


def settings(engine_url: str, **flow: Any) -> Any:
    tenants = [
        {"name": "planner", "api_keys": [KEYS["planner"]], "priority": "interactive"},
        {"name": "articles", "api_keys": [KEYS["articles"]], "priority": "batch"},
        {"name": "reports", "api_keys": [KEYS["reports"]], "priority": "standard"},
    ]
    return fast_settings(
        {"standin": [engine_url]}, tenants=tenants, flow={"max_num_seqs": 2, "batch_headroom": 0, **flow}
    )


def auth(tenant: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}", **headers}


async def post(client: httpx.AsyncClient, url: str, tenant: str, rid: str, **headers: str) -> httpx.Response:
    return await client.post(
        f"{url}/v1/chat/completions",
        json=chat_body(rid, max_tokens=4),
        headers=auth(tenant, **{"x-request-id": rid}, **headers),
        timeout=120,
    )


async def until(predicate: Callable[[], bool], what: Callable[[], object] | str = "") -> None:
    """Poll without blocking the loop the test's requests run on (generous: a busy machine)."""
    await asyncio.to_thread(wait_for, predicate, 60, 0.02, what)


def queued(gw: Any, **labels: str) -> float:
    return gw.metric("gateway_flow_queued", **labels)


@ONE_QUEUE
async def test_requests_wait_only_when_full_and_go_by_class_as_room_appears(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url))
    engine.faults(hold=True)
    async with httpx.AsyncClient() as client:
        running = [asyncio.create_task(post(client, gw.url, "articles", f"run-{i}")) for i in range(2)]
        await until(lambda: engine.stats()["held"] == 2, engine.stats)
        # let in at once, unanswered: each is on its tenant's counter already (its reservation:
        # its max_tokens of 4, booked as it was written to the engine), not only once it has settled
        assert gw.metric("gateway_flow_virtual_tokens", tenant="articles") == 2 * 4
        batch = [asyncio.create_task(post(client, gw.url, "articles", f"batch-{i}")) for i in range(2)]
        await until(lambda: queued(gw, **{"class": "batch"}) == 2)
        standard = asyncio.create_task(post(client, gw.url, "reports", "standard"))
        interactive = asyncio.create_task(post(client, gw.url, "planner", "interactive"))
        await until(lambda: queued(gw) == 4)
        assert engine.stats()["started"] == 2  # nothing beyond max-num-seqs reached the engine
        engine.faults()  # later requests are not held
        httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        answers = await asyncio.gather(*running, *batch, standard, interactive)
    assert [a.status_code for a in answers] == [200] * 6
    timings = httpx.get(f"{engine.url}/_standin/timings", timeout=10).json()["requests"]
    arrived = sorted(["batch-0", "batch-1", "standard", "interactive"], key=lambda rid: timings[rid]["arrived"])
    assert arrived[:2] == ["interactive", "standard"], arrived
    assert engine.stats()["peak_running"] <= 2
    assert gw.metric("gateway_flow_admitted_total", tenant="planner", queued="true") == 1


@ONE_QUEUE
async def test_a_full_queue_and_a_long_wait_answer_429_with_retry_after(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, max_queued={"batch": 1}, max_wait={"standard": 0.2}))
    engine.faults(hold=True)
    async with httpx.AsyncClient() as client:
        running = [asyncio.create_task(post(client, gw.url, "articles", f"run-{i}")) for i in range(2)]
        await until(lambda: engine.stats()["held"] == 2, engine.stats)
        waiting = asyncio.create_task(post(client, gw.url, "articles", "waiting"))
        await until(lambda: queued(gw) == 1)
        full = await post(client, gw.url, "articles", "full")
        timed_out = await post(client, gw.url, "reports", "late")
        httpx.post(f"{engine.url}/_standin/release", timeout=10)
        engine.faults()
        rest = await asyncio.gather(*running, waiting)
    for answer, code in ((full, "queue_full"), (timed_out, "queue_timeout")):
        assert answer.status_code == 429, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == code, error
        assert answer.headers["x-request-id"]
    assert [a.status_code for a in rest] == [200] * 3
    assert engine.stats()["started"] == 3
    assert gw.metric("gateway_flow_shed_total", reason="queue_full") == 1
    assert gw.metric("gateway_flow_shed_total", reason="queue_timeout", tenant="reports") == 1


@ONE_QUEUE
async def test_a_higher_class_displaces_the_newest_batch_request_when_every_queue_is_full(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, max_queued_total=1))
    engine.faults(hold=True)
    async with httpx.AsyncClient() as client:
        running = [asyncio.create_task(post(client, gw.url, "articles", f"run-{i}")) for i in range(2)]
        await until(lambda: engine.stats()["held"] == 2, engine.stats)
        batch = asyncio.create_task(post(client, gw.url, "articles", "batch"))
        await until(lambda: queued(gw) == 1)
        interactive = asyncio.create_task(post(client, gw.url, "planner", "interactive"))
        displaced = await batch
        httpx.post(f"{engine.url}/_standin/release", timeout=10)
        engine.faults()
        rest = await asyncio.gather(*running, interactive)
    assert displaced.status_code == 429 and displaced.json()["error"]["code"] == "queue_displaced"
    assert [a.status_code for a in rest] == [200] * 3


@ONE_QUEUE
async def test_a_client_that_leaves_while_queued_never_reaches_the_engine(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url))
    engine.faults(hold=True)
    async with httpx.AsyncClient() as client:
        running = [asyncio.create_task(post(client, gw.url, "articles", f"run-{i}")) for i in range(2)]
        await until(lambda: engine.stats()["held"] == 2, engine.stats)
        leaving = asyncio.create_task(post(client, gw.url, "articles", "leaving"))
        await until(lambda: queued(gw) == 1)
        leaving.cancel()  # the client closes its connection
        await until(lambda: gw.metric("gateway_flow_shed_total", reason="client_left") == 1)
        assert queued(gw) == 0
        httpx.post(f"{engine.url}/_standin/release", timeout=10)
        engine.faults()
        assert [a.status_code for a in await asyncio.gather(*running)] == [200] * 2
        after = await post(client, gw.url, "articles", "after")
    assert after.status_code == 200
    timings = httpx.get(f"{engine.url}/_standin/timings", timeout=10).json()["requests"]
    assert "leaving" not in timings and engine.stats()["started"] == 3


def test_the_class_sets_vllms_priority_a_client_may_lower_never_raise(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, set_priority=True))

    def sent(tenant: str, **headers: str) -> Any:
        body = chat_body(priority=-100)  # a client's own priority is never the engine's
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=auth(tenant, **headers), timeout=30)
        assert answer.status_code == 200, answer.text
        return engine.stats()["last_request"]["body"].get("priority")

    assert sent("planner") == 0
    assert sent("reports") == 1
    assert sent("articles") == 2
    assert sent("planner", **{"x-priority": "batch"}) == 2
    assert sent("articles", **{"x-priority": "interactive"}) == 2
    assert sent("reports", **{"x-priority": "nonsense"}) == 1


def test_without_priority_scheduling_no_priority_field_is_sent(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url))  # urls only: no profile says scheduling-policy: priority
    answer = httpx.post(
        f"{gw.url}/v1/chat/completions", json=chat_body(priority=3), headers=auth("planner"), timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert "priority" not in engine.stats()["last_request"]["body"]


def test_no_engine_for_the_model_is_503_not_a_queue(gateway):
    gw = gateway(settings("http://127.0.0.1:9"))  # nothing listens there

    def down() -> bool:
        answer = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers=auth("articles"), timeout=60)
        return answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_engine"

    wait_for(down, 60)


@ONE_QUEUE
def test_the_access_log_line_carries_class_and_wait_and_metrics_show_the_gate(engines, gateway):
    [engine] = engines(1)
    lines: list[dict[str, Any]] = []
    gw = gateway(settings(engine.url), log_request=lambda **fields: lines.append(fields))
    answer = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json=chat_body(),
        headers=auth("planner", **{"x-priority": "standard"}),
        timeout=30,
    )
    assert answer.status_code == 200
    wait_for(lambda: lines, 30)
    assert lines[-1]["priority"] == "standard" and 0 <= lines[-1]["queued_s"] < 60
    json.dumps(lines[-1])  # a JSON line
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    for family in (
        "gateway_flow_in_flight",
        "gateway_flow_capacity",
        "gateway_flow_engine_saturation",
        "gateway_flow_virtual_tokens",
        "gateway_flow_admitted_total",
        "gateway_flow_wait_seconds_bucket",
        "gateway_flow_served_tokens_total",
    ):
        assert family in text, family
    assert gw.metric("gateway_flow_capacity", model="standin") == 2
    assert gw.metric("gateway_flow_virtual_tokens", tenant="planner") > 0


async def test_the_engines_batch_is_never_overfilled_with_one_worker_or_two(engines, gateway):
    """Each of N workers gates against its share, ceil(max-num-seqs / N): together never more
    than the engine's batch (plus N-1), whichever worker the kernel gives each connection."""
    [engine] = engines(1, ttft_ms=30.0, itl_ms=5.0, tokens=20)
    gw = gateway(settings(engine.url, max_num_seqs=2))
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        answers = await asyncio.gather(*(post(client, gw.url, "articles", f"r-{i}") for i in range(12)))
    assert [a.status_code for a in answers] == [200] * 12
    assert engine.stats()["finished"] == 12
    assert engine.stats()["peak_running"] <= 2 + (gw.workers - 1), engine.stats()
