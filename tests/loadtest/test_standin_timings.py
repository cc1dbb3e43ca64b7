"""The stand-in's additions for the load tester: engine-side timings and cached_tokens."""

import json

import httpx
import pytest

from standin import StandinConfig, build_app
from tests.support import serve_in_thread

MESSAGES = [
    {
        "role": "user",
        "content": "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen",
    }
]


def stream(http, url, request_id, **body):
    lines = []
    with http.stream(
        "POST",
        f"{url}/v1/chat/completions",
        headers={"x-request-id": request_id},
        json={
            "model": "standin",
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
            **body,
        },
    ) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.fixture
def engine():
    config = StandinConfig(ttft_ms=40, itl_ms=10, tokens=3)
    with serve_in_thread(build_app(config)) as url, httpx.Client(timeout=10) as http:
        yield url, http


def test_timings_per_request_id_with_the_known_delays(engine):
    url, http = engine
    stream(http, url, "req-a")
    stream(http, url, "req-b", standin={"ttft_ms": 80})
    timings = http.get(f"{url}/_standin/timings").json()
    assert timings["clock"] == "perf_counter"
    a, b = timings["requests"]["req-a"], timings["requests"]["req-b"]
    # first token 40 ms after arrival (uvloop timers: 1 ms resolution), then 2 more 10 ms apart
    assert a["ttft_s"] == pytest.approx(a["first_token"] - a["arrived"])
    assert a["ttft_s"] >= 0.039 and b["ttft_s"] >= 0.079
    assert a["tokens"] == 3 and a["last_token"] - a["arrived"] >= 0.059
    assert a["arrived"] < a["first_token"] <= a["last_token"] <= a["ended"]
    assert b["arrived"] > a["ended"]  # sent one after the other
    assert http.delete(f"{url}/_standin/timings").json()["requests"] == {}
    assert http.get(f"{url}/_standin/timings").json()["requests"] == {}


def test_cached_tokens_only_when_configured(engine):
    url, http = engine
    usage = stream(http, url, "x")[-1]["usage"]
    assert "prompt_tokens_details" not in usage  # vLLM's default: no details
    with serve_in_thread(
        build_app(StandinConfig(ttft_ms=1, itl_ms=1, tokens=2, prompt_tokens_details=True))
    ) as caching:
        first = stream(http, caching, "1")[-1]["usage"]
        second = stream(http, caching, "2")[-1]["usage"]
        plain = http.post(f"{caching}/v1/chat/completions", json={"model": "standin", "messages": MESSAGES}).json()[
            "usage"
        ]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # the same prompt again: its full 16-word blocks are found in the prefix cache
    assert second["prompt_tokens_details"]["cached_tokens"] == 16
    assert plain["prompt_tokens_details"] == {"cached_tokens": 16}
