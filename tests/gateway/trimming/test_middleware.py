"""The old ASGI form, TrimmingMiddleware, while app.py still uses it: it delegates to the step.

These tests go with the class when the router calls `HistoryTrimming` itself.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.engine.profiles import TrimmingConfig
from server.gateway.trimming.middleware import TrimmingMiddleware
from tests.gateway.trimming.test_step import MODEL, StandinTarget, _Recorder, conversation
from tests.standin import StandinConfig, build_app, count_chat_tokens
from tests.support import serve_in_thread


@pytest.mark.parametrize("raw", [
    b"{not json",
    b"[1, 2]",
    b'{"model": "standin"}',
    b'{"model": "standin", "messages": "hi"}',
    b'{"model": "standin", "messages": [{"content": "no role"}]}',
    b'{"model": "standin", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
    b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
])
def test_what_is_not_a_trimmable_chat_request_passes_untouched(raw):
    recorder = _Recorder()
    target = StandinTarget(TrimmingConfig(), max_model_len=10)

    async def lookup(model):
        return target if model == MODEL else None

    with serve_in_thread(TrimmingMiddleware(recorder, lookup=lookup)) as url:
        response = httpx.post(f"{url}/v1/chat/completions", content=raw)
        assert response.status_code == 200
        assert "x-trim-status" not in response.headers
        assert recorder.bodies == [raw]
        assert target.calls == []


def test_a_rewritten_body_has_the_right_content_length():
    recorder = _Recorder()
    engine = build_app(StandinConfig(model=MODEL))
    target = StandinTarget(TrimmingConfig(history_budget_tokens=100))

    async def lookup(model):
        return target

    with serve_in_thread(engine) as engine_url:
        target.url = engine_url
        with serve_in_thread(TrimmingMiddleware(recorder, lookup=lookup)) as url:
            messages = conversation(20)
            response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages})
            assert response.headers["x-trim-status"] == "trimmed"
    body = recorder.bodies[0]
    assert int(recorder.headers[0][b"content-length"]) == len(body)
    assert count_chat_tokens(json.loads(body)["messages"]) <= 100


def test_a_refusal_and_other_paths_through_the_middleware():
    engine = build_app(StandinConfig(model=MODEL, max_model_len=1000, ttft_ms=1, itl_ms=1, tokens=4))
    target = StandinTarget(TrimmingConfig(mode="strict"))

    async def lookup(model):
        return target if model == MODEL else None

    with serve_in_thread(TrimmingMiddleware(engine, lookup=lookup)) as url:
        target.url = url
        response = httpx.post(f"{url}/v1/chat/completions", timeout=10.0,
                              json={"model": MODEL, "messages": conversation(61), "max_tokens": 100})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert response.headers["x-trim-status"] == "rejected"
        assert "x-trim-status" not in httpx.get(f"{url}/v1/models").headers
        other = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert other.status_code == 200 and "x-trim-status" not in other.headers
