"""History trimming as wired into the gateway: the model's budget and token counts come from its engines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.config import TrimmingConfig
from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.trimming.history import responses_history
from standin.responses import ResponsesStandin
from tests.gateway.conftest import Gateway, fast_settings
from tests.gateway.trimming.responses_input import responses_conversation
from tests.support import serve_in_thread


def long_chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} " + "word " * 20})
        messages.append({"role": "assistant", "content": "answer " * 20})
    messages.append({"role": "user", "content": "last question"})
    return messages


@contextlib.contextmanager
def _trimming_gateway(engine_url: str, trimming: TrimmingConfig) -> Iterator[Gateway]:
    settings = fast_settings({"standin": [engine_url]})
    settings.models[0].trimming = trimming
    app = create_app(settings, plan_deployment(settings.models).served_models(), registry=CollectorRegistry())
    with serve_in_thread(app) as url:
        yield Gateway(url, app)


def test_a_url_model_is_not_trimmed_unless_configured(engines, gateway):
    (engine,) = engines(1, max_model_len=200)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    response = httpx.post(
        f"{gw.url}/v1/chat/completions",
        timeout=10,
        json={"model": "standin", "messages": long_chat(10), "max_tokens": 16},
    )
    assert response.status_code == 400  # the engine's own context-length error
    assert "x-trim-status" not in response.headers


@pytest.mark.one_process("reads the gateway's trimming step")
def test_configured_trimming_fits_the_history_into_the_engines_max_model_len(engines, gateway):
    (engine,) = engines(1, max_model_len=200)
    settings = fast_settings({"standin": [engine.url]})
    settings.models[0].trimming = TrimmingConfig(mode="auto", default_max_tokens=16)
    gw = gateway(settings)
    assert gw.state.upstreams.models["standin"].max_model_len == 200  # read from the engine's /v1/models
    response = httpx.post(
        f"{gw.url}/v1/chat/completions",
        timeout=10,
        json={"model": "standin", "messages": long_chat(10), "max_tokens": 16},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trim-status"] == "trimmed"
    assert int(response.headers["x-trimmed-messages"]) > 0
    sent = engine.stats()["last_request"]["body"]["messages"]
    assert sent[0] == {"role": "system", "content": "be brief"}
    assert sent[-1] == {"role": "user", "content": "last question"}
    assert response.json()["usage"]["prompt_tokens"] <= 200 - 16
    assert engine.stats()["tokenize_calls"] > 0
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'gateway_trimmed_messages_total{model="standin"}' in metrics


async def test_tool_definitions_are_sent_to_the_engines_tokenizer(engines):
    """Templates render `tools` into the prompt: the gateway's token counts must include them, so
    its tokenize call carries them (and the middleware knows it may pass them)."""
    from server.deploy.plan import plan_deployment
    from server.gateway.replicas.pool import EnginePool
    from server.gateway.trimming.step import accepts_tools as _accepts_tools
    from server.gateway.trimming.target import EngineTrimTarget

    (engine,) = engines(1, max_model_len=200)
    settings = fast_settings({"standin": [engine.url]})
    assert _accepts_tools(EngineTrimTarget)
    upstreams = EnginePool.from_models(plan_deployment(settings.models).served_models())
    tools = [{"type": "function", "function": {"name": "search_places", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "find museums"}]
    async with httpx.AsyncClient() as client:
        target = EngineTrimTarget(upstreams.models["standin"], client, httpx.Timeout(5.0))
        await target.tokenize(messages, True, tools=tools)
        assert engine.stats()["last_tokenize"]["body"]["tools"] == tools
        await target.tokenize(messages, True)
        assert "tools" not in engine.stats()["last_tokenize"]["body"]


async def test_counting_tokens_takes_no_routing_turn_and_counts_no_request(engines):
    """Trimming's /tokenize is the gateway's own side request: under round robin it must not move
    the turn (run a of the routing experiment split 15:33 because it did), nor count as outstanding."""
    from server.deploy.plan import plan_deployment
    from server.gateway.replicas.pool import EnginePool
    from server.gateway.trimming.target import EngineTrimTarget

    pair = engines(2, max_model_len=200)
    settings = fast_settings({"standin": [e.url for e in pair]}, routing={"policy": "round_robin"})
    pool = EnginePool.from_models(plan_deployment(settings.models).served_models()).models["standin"]
    for engine in pool.engines:
        engine.healthy = True
    chosen = []
    async with httpx.AsyncClient() as client:
        target = EngineTrimTarget(pool, client, httpx.Timeout(5.0))
        for _ in range(4):
            decision = pool.route(settings.routing)
            assert decision is not None
            chosen.append(decision.engine.id)
            pool.release(decision.engine)
            await target.tokenize([{"role": "user", "content": "hi"}], True)
            assert all(e.outstanding == 0 for e in pool.engines)
    assert chosen[0] != chosen[1] and chosen[0::2] == [chosen[0]] * 2 and chosen[1::2] == [chosen[1]] * 2


def test_a_responses_conversation_is_trimmed_through_the_gateway():
    """/v1/responses through the whole gateway: the engine (a stand-in that refuses over-long
    prompts as vLLM does) gets the instructions, the newest items and whole tool calls, under the
    gateway's own response id; a follow-up with `previous_response_id` is built from the gateway's
    store and trimmed too."""
    engine = ResponsesStandin.build(responses_history, model="standin", max_model_len=1000)
    with serve_in_thread(engine) as url:
        items = responses_conversation(40)
        body = {"model": "standin", "input": items, "instructions": "be brief", "max_output_tokens": 100}
        with _trimming_gateway(url, TrimmingConfig(mode="auto")) as gw:
            response = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.headers["x-trim-status"] == "trimmed"
            sent = engine.responses[-1]
            assert sent["instructions"] == "be brief" and sent["request_id"].startswith("resp_")
            kept = sent["input"]
            assert kept[0] == items[0] and kept[-1] == items[-1] and len(kept) < len(items)
            assert int(response.headers["x-trimmed-messages"]) == len(items) - len(kept)
            calls = {i["call_id"] for i in kept if i.get("type") == "function_call"}
            assert calls == {i["call_id"] for i in kept if i.get("type") == "function_call_output"}
            assert response.json()["usage"]["input_tokens"] <= 900
            assert 'gateway_trimmed_messages_total{model="standin"}' in httpx.get(f"{gw.url}/metrics").text

            # A follow-up by id: the gateway builds the whole input from its own store and trims it
            # like any other (app.responses), instead of an engine refusing an over-long history.
            follow_up = {**body, "input": "and now?", "previous_response_id": response.json()["id"]}
            again = httpx.post(f"{gw.url}/v1/responses", json=follow_up, timeout=30)
            assert again.status_code == 200, again.text
            assert again.headers["x-trim-status"] == "trimmed"
            assert again.json()["previous_response_id"] == response.json()["id"]
            sent = engine.responses[-1]
            assert sent["store"] is False and "previous_response_id" not in sent
            assert sent["input"][-1]["content"][0]["text"] == "and now?"


@pytest.mark.one_process("reads the gateway's trimming step and its count cache")
def test_twenty_thousand_new_messages_cost_a_bounded_number_of_tokenize_calls(engines, gateway):
    """Issue 15: one request of 20,000 messages made 20,008 /tokenize calls and churned the shared
    count cache. Now it makes at most calibration + TokenCounter.max_calls + verification calls,
    still answers with a trimmed prompt that fits, and earlier conversations stay cached."""
    (engine,) = engines(1, max_model_len=4096)
    settings = fast_settings({"standin": [engine.url]})
    settings.models[0].trimming = TrimmingConfig(mode="auto", default_max_tokens=16)
    gw = gateway(settings)
    (step,) = gw.app.proxied.steps
    earlier = long_chat(10)
    first = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={"model": "standin", "messages": earlier})
    assert first.status_code == 200, first.text
    before = engine.stats()["tokenize_calls"]
    flood = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20_001)]
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", timeout=120, json={"model": "standin", "messages": flood, "max_tokens": 16}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trim-status"] == "trimmed"
    calls = engine.stats()["tokenize_calls"] - before
    assert calls <= step.counter.max_calls + 3  # + the verification rounds (calibrated already)
    sent = engine.stats()["last_request"]["body"]["messages"]
    assert sent[-1] == flood[-1] and response.json()["usage"]["prompt_tokens"] <= 4096 - 16
    quick = step.counter.estimate_cached("standin", earlier)
    assert quick is not None and quick.unseen == []  # still cached: not flushed
