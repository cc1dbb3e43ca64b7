"""What a request costs a replica before its first token (from the engine's own figures) and the
work in flight a new request would wait behind: pure, on made-up figures."""

from __future__ import annotations

import pytest

from server.gateway.replicas.engine import EngineMetrics
from server.gateway.replicas.service import MIN_TOKENS, InFlight, PrefillCost


def figures(
    *, queried: float = 20_000, hit: float = 8_000, prefill: float = 0.3, first: float = 1.0, requests: float = 40
):
    return EngineMetrics(
        prefix_queries_tokens=queried,
        prefix_hits_tokens=hit,
        prefill_seconds=prefill,
        first_token_seconds=first,
        first_tokens=requests,
    )


def test_the_cost_per_token_is_prefill_seconds_over_the_tokens_computed_and_the_rest_is_fixed():
    cost = PrefillCost.of(figures())
    assert cost is not None
    assert cost.per_token == pytest.approx(0.3 / 12_000)  # 12,000 tokens computed (not found in the cache)
    assert cost.fixed == pytest.approx((1.0 - 0.3) / 40)  # what the computed tokens do not explain, per request
    assert cost.seconds(128) == pytest.approx(cost.fixed + 128 * 0.3 / 12_000)
    assert cost.seconds(-5) == cost.fixed


def test_no_cost_until_the_engine_has_computed_enough_or_reports_every_figure():
    assert PrefillCost.of(EngineMetrics()) is None
    assert PrefillCost.of(figures(queried=MIN_TOKENS - 1, hit=0)) is None
    assert PrefillCost.of(figures(requests=0)) is None
    assert PrefillCost.of(figures(prefill=-1.0)) is None
    no_prefill = EngineMetrics(
        prefix_queries_tokens=20_000, prefix_hits_tokens=0, first_token_seconds=1.0, first_tokens=4
    )
    assert PrefillCost.of(no_prefill) is None  # an engine without the prefill histogram
    assert PrefillCost.of(figures(prefill=2.0, first=1.0)) == PrefillCost(2.0 / 12_000, 0.0)  # fixed never negative


def test_the_wait_is_what_is_left_of_the_requests_in_flight_before_their_first_tokens():
    cost = PrefillCost(per_token=0.0001, fixed=0.010)  # 10 ms + 0.1 ms a token
    inflight = InFlight()
    assert inflight.left(cost, now=5.0) == 0.0  # idle
    inflight.sent(at=5.0, tokens=900)  # 100 ms to its first token
    assert inflight.left(cost, now=5.0) == pytest.approx(0.100)
    assert inflight.left(cost, now=5.06) == pytest.approx(0.040)
    assert inflight.left(cost, now=5.2) == 0.0  # decoding now: a newcomer's prefill runs beside it
    inflight.sent(at=5.1, tokens=0)  # a request whose whole prompt was cached: the fixed part only
    assert inflight.left(cost, now=5.105) == pytest.approx(0.005)
    assert inflight.left(None, now=5.105) == 0.0  # the engine's costs unknown: no wait to weigh
    assert len(inflight) == 2


def test_requests_end_oldest_first_and_an_extra_end_is_harmless():
    inflight = InFlight()
    inflight.sent(at=1.0, tokens=100)
    inflight.sent(at=2.0, tokens=200)
    inflight.ended()
    assert list(inflight.requests) == [(2.0, 200)]
    inflight.ended()
    inflight.ended()  # a release the pool never counted (an engine found anew): nothing to pop
    assert len(inflight) == 0
