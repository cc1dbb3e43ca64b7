"""Requests refused before routing are counted under the served model they named, never under a name
nobody serves (the `model` label's values stay the served models and `_unknown`)."""

from __future__ import annotations

import re

import httpx

from tests.gateway.conftest import chat_body, fast_settings
from tests.support import WAIT_TIMEOUT, wait_for

REFUSALS = [
    # (path, body or raw bytes, headers, status, label)
    ("/v1/chat/completions", chat_body(messages=[]), {}, 400, "standin"),  # bad body after the model
    ("/v1/chat/completions", chat_body(stream="yes"), {}, 400, "standin"),
    ("/v1/chat/completions", chat_body(stream_options={"include_usage": 1}), {}, 400, "standin"),
    ("/v1/completions", {"model": "standin"}, {}, 400, "standin"),  # no prompt
    ("/v1/responses", {"model": "standin", "input": "hi", "previous_response_id": 7}, {}, 400, "standin"),
    ("/v1/responses", {"model": "standin", "input": "hi", "previous_response_id": "resp_x"}, {}, 404, "standin"),
    ("/v1/chat/completions", chat_body(model="not-served", messages=[]), {}, 400, "_unknown"),
    ("/v1/chat/completions", chat_body(model="not-served"), {}, 404, "_unknown"),
    ("/v1/chat/completions", chat_body(model="x" * 10_000), {}, 404, "_unknown"),
    ("/v1/chat/completions", b'{"model": "standin", "messages": [', {}, 400, "_unknown"),  # model never read
    ("/v1/chat/completions", chat_body(), {"authorization": "Bearer wrong"}, 401, "_unknown"),  # body not read
]


def _requests_total(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=WAIT_TIMEOUT).text
    found = re.findall(r'^gateway_requests_total\{code="(\d+)",model="([^"]*)"\} (\S+)$', text, re.M)
    return {(code, model): float(value) for code, model, value in found}


def test_refusals_are_labelled_with_the_served_model_they_named_and_nothing_else(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}, auth={"api_keys_env": "K"}), environ={"K": "sk-right"})
    expected: dict[tuple[str, str], float] = {}
    for path, body, headers, status, label in REFUSALS:
        headers = {"authorization": "Bearer sk-right", **headers}
        if isinstance(body, bytes):
            answer = httpx.post(f"{gw.url}{path}", content=body, headers=headers, timeout=WAIT_TIMEOUT)
        else:
            answer = httpx.post(f"{gw.url}{path}", json=body, headers=headers, timeout=WAIT_TIMEOUT)
        assert answer.status_code == status, (path, body, answer.text)
        assert set(answer.json()) == {"error"}
        expected[(str(status), label)] = expected.get((str(status), label), 0) + 1
    wait_for(lambda: _requests_total(gw.url) == expected, what=lambda: _requests_total(gw.url))
    assert engine.stats()["started"] == 0
    text = httpx.get(f"{gw.url}/metrics", timeout=WAIT_TIMEOUT).text
    assert set(re.findall(r'model="([^"]*)"', text)) <= {"standin", "_unknown"}
    in_flight = re.findall(r"^gateway_requests_in_flight\{[^}]*\} (\S+)$", text, re.M)
    assert in_flight and all(float(v) == 0 for v in in_flight)
