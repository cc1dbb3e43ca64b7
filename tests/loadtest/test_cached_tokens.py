"""Cached prompt tokens per request and per turn, and the engine's prefix-cache counters."""

import math

import httpx
import pytest

from loadtest import scenarios
from loadtest.client import ChatClient, make_transport
from loadtest.console import console_table
from loadtest.engine_probe import EngineProbe
from loadtest.metrics import cached_share, per_turn, summarize
from loadtest.records import RequestRecord
from loadtest.report import RunOutcome, markdown
from loadtest.runner import LoadShape, Runner, StopRule
from standin import StandinConfig, build_app
from tests.support import serve_in_thread


def rec(turn, prompt, cached, ok=True):
    return RequestRecord(
        request_id=f"r{turn}-{prompt}",
        turn=turn,
        prompt_tokens=prompt,
        cached_tokens=cached,
        ttft_s=0.01,
        e2e_s=0.02,
        error_kind=None if ok else "http",
    )


def test_cached_share_sums_tokens_over_requests_that_reported_them():
    records = [rec(0, 100, 0), rec(1, 300, 200), rec(1, 100, 100), rec(1, 50, None), rec(1, 1000, 1000, ok=False)]
    share = cached_share(records)
    assert share == {"total_cached_tokens": 300, "cached_tokens_reported": 3, "cached_token_ratio": 300 / 500}
    turns = {row["turn"]: row for row in per_turn(records)}
    assert turns[0]["cached_token_ratio"] == 0.0
    assert turns[1]["cached_token_ratio"] == pytest.approx(300 / 400)
    assert turns[1]["prompt_tokens"] == 450  # every successful request's usage, reported or not
    assert summarize(records)["cached_token_ratio"] == pytest.approx(0.6)


def test_no_cached_tokens_reported_is_nan_not_zero():
    share = cached_share([rec(0, 100, None)])
    assert share["cached_tokens_reported"] == 0 and math.isnan(share["cached_token_ratio"])


@pytest.fixture(scope="module")
def caching_engine():
    """A stand-in that reports usage.prompt_tokens_details.cached_tokens."""
    config = StandinConfig(ttft_ms=5, itl_ms=1, tokens=4, prompt_tokens_details=True)
    with serve_in_thread(build_app(config)) as url:
        yield url


async def test_conversation_turns_find_their_history_in_the_cache(caching_engine):
    async with (
        make_transport("raw", max_connections=2, timeout_s=10) as http,
        httpx.AsyncClient(trust_env=False) as metrics_http,
    ):
        client = ChatClient(caching_engine, http=http, model="standin", timeout_s=10)
        probe = EngineProbe(caching_engine + "/metrics", http=metrics_http)
        sessions = scenarios.itinerary(0, turns=4, max_tokens=4)
        result = await Runner(client, sessions, LoadShape(concurrency=1), StopRule(num_requests=8), probe=probe).run()
    assert all(r.ok for r in result.records)
    assert all(r.cached_tokens is not None and 0 <= r.cached_tokens <= r.prompt_tokens for r in result.records)
    # later turns resend the whole history: most of their prompt is cached
    by_turn = {row["turn"]: row for row in per_turn(result.measured)}
    assert by_turn[3]["cached_token_ratio"] > by_turn[0]["cached_token_ratio"]
    assert by_turn[3]["cached_token_ratio"] > 0.5
    # the engine's own counters moved by at least what the requests reported
    engine = result.engine
    assert engine["prefix_cache_hits_total"] >= sum(r.cached_tokens for r in result.records)
    outcome = RunOutcome.of(result, caching_engine, {})
    text = console_table([outcome], [])
    assert "per turn" in text and "engine prefix cache" in text
    report = markdown([outcome], [], {}, [])
    assert "cached share" in report


async def test_a_server_without_details_leaves_cached_tokens_empty(standin):
    async with make_transport("raw", max_connections=1, timeout_s=10) as http:
        client = ChatClient(standin, http=http, model="standin", timeout_s=10)
        result = await Runner(
            client,
            scenarios.random_prompts(0, input_chars=40, max_tokens=2),
            LoadShape(concurrency=1),
            StopRule(num_requests=2),
        ).run()
    assert all(r.ok and r.cached_tokens is None for r in result.records)
    assert math.isnan(summarize(result.measured)["cached_token_ratio"])
