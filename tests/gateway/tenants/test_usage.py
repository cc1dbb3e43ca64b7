"""The usage ledger: rows per tenant, model and minute, summed since a time (server.gateway.tenants.usage)."""

from __future__ import annotations

from server.gateway.tenants.usage import UsageLedger


def test_usage_summed_per_tenant_and_model_since_a_minute():
    now = [600.0]  # minute 10
    ledger = UsageLedger(clock=lambda: now[0])
    ledger.record("a", "m", 200, 10, 4, 5)
    ledger.record("a", "m", 429, 0, 0, 0)
    now[0] = 725.0  # minute 12
    ledger.record("a", "m", 200, 7, 0, 3)
    ledger.record("b", "m", 200, 1, 1, 1)
    every = ledger.since(None)
    assert every[("a", "m")].requests == {200: 2, 429: 1}
    assert (every["a", "m"].prompt_tokens, every["a", "m"].cached_prompt_tokens, every["a", "m"].completion_tokens) == (
        17,
        4,
        8,
    )
    later = ledger.since(720.0)
    assert later["a", "m"].requests == {200: 1} and later["a", "m"].prompt_tokens == 7
    assert later["b", "m"].completion_tokens == 1
    assert ledger.since(780.0) == {}
    assert ledger.since(659.0)["a", "m"].requests == {200: 2, 429: 1}  # minute 10 counts whole


def test_minutes_past_the_retention_are_dropped():
    now = [0.0]
    ledger = UsageLedger(clock=lambda: now[0], retention_minutes=2)
    ledger.record("a", "m", 200, 1, 0, 1)
    now[0] = 60.0
    ledger.record("a", "m", 200, 1, 0, 1)
    now[0] = 120.0
    ledger.record("a", "m", 200, 1, 0, 1)
    assert ledger.since(None)["a", "m"].requests == {200: 2}
