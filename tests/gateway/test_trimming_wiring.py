"""History trimming as wired into the gateway: the model's budget and token counts come from its engines."""

from __future__ import annotations

import httpx

from server.engine.profiles import TrimmingConfig
from tests.gateway.conftest import fast_settings


def long_chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i} " + "word " * 20})
        messages.append({"role": "assistant", "content": "answer " * 20})
    messages.append({"role": "user", "content": "last question"})
    return messages


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
    from server.gateway.engines.pool import EnginePool
    from server.gateway.trimming.step import accepts_tools as _accepts_tools
    from server.gateway.trimming.target import EngineTrimTarget

    (engine,) = engines(1, max_model_len=200)
    settings = fast_settings({"standin": [engine.url]})
    assert _accepts_tools(EngineTrimTarget)
    upstreams = EnginePool.from_models(plan_deployment(settings.models).served_models())
    tools = [{"type": "function", "function": {"name": "search_places", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "find museums"}]
    async with httpx.AsyncClient() as client:
        target = EngineTrimTarget(upstreams.models["standin"], client, settings.routing, httpx.Timeout(5.0))
        await target.tokenize(messages, True, tools=tools)
        assert engine.stats()["last_tokenize"]["body"]["tools"] == tools
        await target.tokenize(messages, True)
        assert "tools" not in engine.stats()["last_tokenize"]["body"]
