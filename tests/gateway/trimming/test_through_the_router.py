"""History trimming as the router runs it (formerly tests of the ASGI TrimmingMiddleware form):
what trimming cannot act on passes untouched, a rewritten body reaches the engine whole, and a
refusal or another endpoint carries the right headers."""

from __future__ import annotations

import httpx
import pytest

from server.config import TrimmingConfig
from standin import count_chat_tokens
from tests.gateway.conftest import fast_settings
from tests.gateway.trimming.test_step import conversation


def _gateway(engines, gateway, trimming: TrimmingConfig, **engine_config):
    (engine,) = engines(1, **engine_config)
    settings = fast_settings({"standin": [engine.url]})
    settings.models[0].trimming = trimming
    return engine, gateway(settings)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": "standin"}', 400),
        (b'{"model": "standin", "messages": "hi"}', 400),
        (b'{"model": "standin", "messages": [{"content": "no role"}]}', 400),
        (b'{"model": "standin", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', None),
        (b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404),
    ],
)
def test_what_is_not_a_trimmable_chat_request_is_not_counted(engines, gateway, raw, status):
    engine, gw = _gateway(engines, gateway, TrimmingConfig(), max_model_len=10)
    response = httpx.post(f"{gw.url}/v1/chat/completions", content=raw, timeout=10)
    assert "x-trim-status" not in response.headers
    assert engine.stats()["tokenize_calls"] == 0
    if status is not None:  # refused by the gateway's own checks, before trimming
        assert response.status_code == status
    else:  # the engine's business: it got the body exactly as sent
        assert engine.stats()["last_request"]["body"]["max_tokens"] == "many"


def test_a_rewritten_body_reaches_the_engine_whole(engines, gateway):
    engine, gw = _gateway(engines, gateway, TrimmingConfig(history_budget_tokens=100))
    response = httpx.post(
        f"{gw.url}/v1/chat/completions", timeout=10, json={"model": "standin", "messages": conversation(20)}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-trim-status"] == "trimmed"
    assert count_chat_tokens(engine.stats()["last_request"]["body"]["messages"]) <= 100


def test_a_refusal_and_the_other_endpoints(engines, gateway):
    engine, gw = _gateway(engines, gateway, TrimmingConfig(mode="strict"), max_model_len=1000)
    response = httpx.post(
        f"{gw.url}/v1/chat/completions",
        timeout=10,
        json={"model": "standin", "messages": conversation(61), "max_tokens": 100},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert response.headers["x-trim-status"] == "rejected"
    assert response.headers["x-request-id"]
    assert "x-trim-status" not in httpx.get(f"{gw.url}/v1/models", timeout=10).headers
    other = httpx.post(f"{gw.url}/v1/completions", json={"model": "standin", "prompt": "hi"}, timeout=10)
    assert other.status_code == 200 and "x-trim-status" not in other.headers
