"""Quotas as pure arithmetic: token buckets on a hand-driven clock, reservation and settlement,
OpenAI's rate-limit headers (server.gateway.tenants.quota)."""

from __future__ import annotations

import pytest

from server.gateway.request.request import output_cap
from server.gateway.settings import TenantLimits
from server.gateway.tenants.errors import QuotaExceeded
from server.gateway.tenants.quota import Quota, format_reset, reservation


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quota(clock: Clock, **limits: object) -> Quota:
    return Quota(TenantLimits.model_validate(limits), clock)


def tokens_level(q: Quota) -> float:
    return q.store.peek(q.key, q.limits)[1]


def headers(pairs: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in pairs}


def test_requests_per_window_then_429_with_retry_after_until_one_refills():
    clock = Clock()
    q = quota(clock, requests_per_minute=3, window_seconds=60)
    for remaining in (2, 1, 0):
        ticket, out = q.admit(10)
        ticket.settle(10)
        assert headers(out)["x-ratelimit-remaining-requests"] == str(remaining)
        assert headers(out)["x-ratelimit-limit-requests"] == "3"
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(10)
    got = headers(refused.value.headers)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert got["retry-after"] == "20" and got["retry-after-ms"] == "20000"  # one request refills in 60/3 s
    assert got["x-ratelimit-reset-requests"] == "1m0s"  # full again in 60 s
    clock.now += 19.9
    with pytest.raises(QuotaExceeded):
        q.admit(10)
    clock.now += 0.1
    ticket, out = q.admit(10)
    assert headers(out)["x-ratelimit-remaining-requests"] == "0"


def test_tokens_reserved_then_settled_from_usage_both_ways():
    clock = Clock()
    q = quota(clock, tokens_per_minute=1000, window_seconds=60)
    ticket, out = q.admit(600)
    assert headers(out)["x-ratelimit-remaining-tokens"] == "400"
    ticket.settle(100)  # used less than reserved: 500 back
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "900"
    ticket.settle(5000)  # settled once only
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "900"
    big, _ = q.admit(800)
    big.settle(1800)  # a longer answer than reserved: the bucket owes 900
    assert tokens_level(q) == pytest.approx(-900)
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(100)  # needs the debt paid and 100 more: 1000 tokens at 1000/60 per second
    assert headers(refused.value.headers)["retry-after-ms"] == "60000"


def test_a_refund_never_fills_past_the_limit():
    clock = Clock()
    q = quota(clock, tokens_per_minute=100)
    ticket, _ = q.admit(50)
    clock.now += 3600
    ticket.settle(0)
    assert tokens_level(q) <= 100
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "100"


def test_settled_without_usage_keeps_the_reservation():
    q = quota(Clock(), tokens_per_minute=100)
    ticket, _ = q.admit(30)
    ticket.settle(None)
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "70"


def test_a_request_larger_than_the_whole_budget_is_refused_without_retry_after():
    q = quota(Clock(), tokens_per_minute=100)
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(101)
    assert "retry-after" not in headers(refused.value.headers)
    assert "Request too large" in refused.value.message


def test_concurrency_slot_freed_on_settle():
    q = quota(Clock(), max_concurrent=2)
    first, out = q.admit(1)
    assert out == []  # no per-minute budget: no x-ratelimit headers
    second, _ = q.admit(1)
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(1)
    assert headers(refused.value.headers)["retry-after"] == "1"
    first.settle(1)
    q.admit(1)
    second.settle(None)
    assert q.store.in_flight[q.key] == 1


def test_the_longest_wait_of_both_buckets_is_the_retry_after():
    clock = Clock()
    q = quota(clock, requests_per_minute=60, tokens_per_minute=60, window_seconds=60)
    q.admit(60)[0].settle(60)
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(30)  # requests: ready in 0 s (59 left); tokens: 30 s
    assert headers(refused.value.headers)["retry-after"] == "30"
    assert "tokens per minute" in refused.value.message


def test_a_test_sized_window_refills_in_seconds():
    clock = Clock()
    q = quota(clock, requests_per_minute=2, window_seconds=1.0)
    q.admit(1)
    q.admit(1)
    with pytest.raises(QuotaExceeded) as refused:
        q.admit(1)
    assert headers(refused.value.headers)["retry-after-ms"] == "500"
    assert headers(refused.value.headers)["retry-after"] == "1"
    clock.now += 0.5
    q.admit(1)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (59.999, "59.999s"), (60, "1m0s"),
     (90, "1m30s"), (361, "6m1s"), (-1, "0s")],
)  # fmt: skip
def test_reset_durations_are_written_as_openai_writes_them(seconds, text):
    assert format_reset(seconds) == text


def test_reservation_is_the_prompt_estimate_plus_the_completion_cap():
    assert reservation(output_cap({}), 400) == 101
    assert reservation(output_cap({"max_tokens": 50}), 400) == 151
    assert reservation(output_cap({"max_completion_tokens": 70, "max_tokens": 50}), 0) == 71  # the newer name wins
    assert reservation(output_cap({"max_output_tokens": 9}), 0) == 10  # Responses
    assert reservation(output_cap({"max_tokens": "50"}), 0) == 1  # not a number: nothing reserved
    assert reservation(output_cap({"max_tokens": True}), 0) == 1
    assert reservation(output_cap({"max_tokens": -3}), 0) == 1


def test_the_rate_limit_headers_of_an_answer_as_openai_writes_them():
    clock = Clock()
    q = quota(clock, requests_per_minute=600, tokens_per_minute=6000)
    _, out = q.admit(300)  # one request (0.1 s of refill) and 300 tokens (3 s of refill) taken
    assert headers(out) == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "599",
        "x-ratelimit-reset-requests": "100ms",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5700",
        "x-ratelimit-reset-tokens": "3s",
    }
    clock.now += 0.0504  # refilled: 599.504 requests (a floor of 599; 49.6 ms to full)
    assert headers(q.headers())["x-ratelimit-remaining-requests"] == "599"
    assert headers(q.headers())["x-ratelimit-reset-requests"] == "50ms"
    clock.now += 10
    assert headers(q.headers())["x-ratelimit-reset-tokens"] == "0s"  # full again
    big, _ = q.admit(6000)
    big.settle(9000)  # a debt: the level below 0 shows as 0 remaining
    assert headers(q.headers())["x-ratelimit-remaining-tokens"] == "0"
    assert headers(q.headers())["x-ratelimit-reset-tokens"] == "1m30s"
