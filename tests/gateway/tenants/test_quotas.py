"""Quotas through a real gateway over sockets: OpenAI's rate-limit headers on every answer, 429
with Retry-After, tokens settled from usage, concurrency, and the OpenAI SDK's own retry.

Each runs with one worker and with `--workers 2` (the `gateway` fixture): the workers share one
set of counters (tenants.counters_host; test_quota_shared.py has the exact counts across them)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import refusing_port, wait_for

LIMITED, OPEN = "sk-limited", "sk-open"


def settings(engine_url: str, **limits: object):
    tenants = [
        {"name": "limited", "api_keys": [LIMITED], "limits": limits},
        {"name": "open", "api_keys": [OPEN]},
    ]
    return fast_settings({"standin": [engine_url]}, tenants=tenants)


def post(url: str, key: str, body: dict | bytes) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30, **kwargs)


def test_every_answer_carries_the_rate_limit_headers_and_over_quota_is_429_with_retry_after(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, requests_per_minute=2, tokens_per_minute=100_000))
    first = post(gw.url, LIMITED, chat_body())
    second = post(gw.url, LIMITED, chat_body(stream=True))
    for answer, remaining in ((first, "1"), (second, "0")):
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-limit-requests"] == "2"
        assert answer.headers["x-ratelimit-remaining-requests"] == remaining
        assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
        assert answer.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) < 100_000
        assert answer.headers["x-ratelimit-reset-tokens"].endswith("s")
    refused = post(gw.url, LIMITED, chat_body())
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "requests per minute: limit 2" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 30  # one request refills in 60 / 2 s
    assert 0 < int(refused.headers["retry-after-ms"]) <= 30_000
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-request-id"]
    assert engine.stats()["started"] == 2  # the refused request never reached the engine
    unlimited = post(gw.url, OPEN, chat_body())  # another tenant's budget is its own
    assert unlimited.status_code == 200
    assert not [h for h in unlimited.headers if h.startswith("x-ratelimit")]


def test_an_answer_the_engine_failed_carries_the_rate_limit_headers_too(engines, gateway):
    """An admitted request took from the budget, so its error answer says so too: an engine's own
    error (relayed), and the gateway's when the engine stays unavailable (the headers are made while
    the engine works, and before any answer that never reached it)."""
    [engine] = engines(1)
    gw = gateway(settings(engine.url, requests_per_minute=5))
    relayed = post(gw.url, LIMITED, {**chat_body(), "standin": {"status": 500}})
    engine.faults(status=503)
    unavailable = post(gw.url, LIMITED, chat_body(stream=True))
    assert relayed.status_code == 500 and unavailable.status_code == 503, (relayed.text, unavailable.text)
    with refusing_port() as port:  # an engine never reached: the gateway's own 502/503
        never = post(gateway(settings(f"http://127.0.0.1:{port}", requests_per_minute=5)).url, LIMITED, chat_body())
    assert never.status_code in (502, 503), never.text
    for answer, remaining in ((relayed, "4"), (unavailable, "3"), (never, "4")):
        assert answer.headers["x-ratelimit-limit-requests"] == "5"
        assert answer.headers["x-ratelimit-remaining-requests"] == remaining
        assert answer.headers["x-request-id"]


@pytest.mark.one_process("settled just after the answer: the next request on another worker may come first")
def test_tokens_are_reserved_from_max_tokens_and_settled_from_the_usage(engines, gateway):
    [engine] = engines(1, tokens=6)
    limit, window = 1000, 3600.0  # refills 1000 / 3600 tokens a second: the test bounds what it adds
    gw = gateway(settings(engine.url, tokens_per_minute=limit, window_seconds=window))
    started = time.monotonic()
    first_raw = json.dumps(chat_body(max_tokens=900)).encode()
    first = post(gw.url, LIMITED, first_raw)
    assert first.status_code == 200, first.text
    reserved_first = len(first_raw) // 4 + 1 + 900
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == limit - reserved_first
    usage = first.json()["usage"]
    used = usage["prompt_tokens"] + usage["completion_tokens"]
    assert used < reserved_first
    second_raw = json.dumps(chat_body(max_tokens=10)).encode()

    def remaining_after_settlement() -> int:
        answer = post(gw.url, LIMITED, second_raw)
        assert answer.status_code == 200, answer.text
        return int(answer.headers["x-ratelimit-remaining-tokens"])

    remaining = remaining_after_settlement()
    refilled = math.ceil((time.monotonic() - started) * limit / window) + 1
    expected = limit - used - (len(second_raw) // 4 + 1 + 10)
    assert expected <= remaining <= expected + refilled
    too_big = post(gw.url, LIMITED, chat_body(max_tokens=5000))
    assert too_big.status_code == 429 and "Request too large" in too_big.json()["error"]["message"]
    assert "retry-after" not in too_big.headers  # waiting would not help


def test_concurrent_requests_over_the_limit_are_429_until_one_ends(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, max_concurrent=1))
    engine.faults(hold=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, gw.url, LIMITED, chat_body())
        wait_for(lambda: engine.stats()["held"] == 1, timeout=30)
        refused = post(gw.url, LIMITED, chat_body())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "concurrent requests: the limit is 1" in refused.json()["error"]["message"]
        httpx.post(f"{engine.url}/_standin/release", timeout=10).raise_for_status()
        assert held.result(timeout=60).status_code == 200
    assert post(gw.url, LIMITED, chat_body()).status_code == 200


def test_the_openai_sdk_retries_after_the_reset_and_succeeds(engines, gateway):
    [engine] = engines(1)
    gw = gateway(settings(engine.url, requests_per_minute=1, window_seconds=3.0))
    assert post(gw.url, LIMITED, chat_body()).status_code == 200  # the one request of this window
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key=LIMITED, max_retries=3, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="standin", messages=[{"role": "user", "content": "hello there"}]
        )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert raw.retries_taken >= 1  # it met the 429 and waited the Retry-After the gateway gave
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 0
    assert engine.stats()["started"] == 2
