"""The event-loop watch: a loop held by synchronous work is measured, logged, and exported."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from prometheus_client import generate_latest

from server.gateway.observability.loop_watch import LoopWatch
from server.gateway.observability.metrics import GatewayMetrics
from tests.gateway.worker_tree import sample

HOLD = 0.6  # seconds the tests hold the loop with synchronous work
WARN = 0.3


async def until(predicate, deadline: float = 60.0) -> None:
    give_up = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < give_up, "the watch never reported the held loop"
        await asyncio.sleep(0.02)


async def hold_the_loop(collect: bool) -> None:
    """Runs synchronous work for HOLD seconds on the loop, as a blocking call in a handler would."""

    def hold() -> None:
        if collect:
            gc.collect()
        time.sleep(HOLD)

    asyncio.get_running_loop().call_soon(hold)
    await asyncio.sleep(0)


@pytest.mark.parametrize("collect", [False, True])
async def test_a_held_loop_is_measured_and_logged_with_whether_a_full_collection_ran(caplog, collect):
    lags: list[float] = []
    watch = LoopWatch(lags.append, interval=0.05, warn_after=WARN)
    caplog.set_level(logging.WARNING, logger="gateway.loop")
    enabled = gc.isenabled()
    gc.disable()  # no collection of the interpreter's own in the window, only the test's
    try:
        await watch.start()
        await until(lambda: len(lags) >= 2)  # the watch is running
        assert max(lags) < WARN, lags
        await hold_the_loop(collect)
        await until(lambda: any(lag >= WARN for lag in lags))
    finally:
        await watch.aclose()
        if enabled:
            gc.enable()
    held = max(lags)
    # The timer due during the hold ran when it ended: late by the hold less at most one interval.
    assert held >= HOLD - 0.05, lags
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.loop" and f"ran {held * 1000:.0f} ms" in r.getMessage()
    ]
    assert ("a full garbage collection ran meanwhile" in line) is collect, line
    assert ("no full garbage collection ran meanwhile" in line) is not collect, line


async def test_the_watch_stops_with_aclose_and_an_unheld_loop_logs_nothing(caplog):
    lags: list[float] = []
    watch = LoopWatch(lags.append, interval=0.01, warn_after=WARN)
    caplog.set_level(logging.WARNING, logger="gateway.loop")
    await watch.start()
    await until(lambda: len(lags) >= 5)
    await watch.aclose()
    seen = len(lags)
    for _ in range(10):
        await asyncio.sleep(0.01)
    assert len(lags) == seen  # no wake-up after aclose
    assert [r for r in caplog.records if r.name == "gateway.loop"] == [] or max(lags) >= WARN
    await watch.aclose()  # twice is harmless


def test_the_lag_is_exported_as_a_histogram():
    metrics = GatewayMetrics()
    for lag in (0.0002, 0.003, 0.4):
        metrics.loop_lag(lag)
    text = generate_latest(metrics.registry).decode()
    assert sample(text, "gateway_event_loop_lag_seconds_count") == [3.0]
    assert sample(text, "gateway_event_loop_lag_seconds_bucket", le="0.001") == [1.0]
    assert sample(text, "gateway_event_loop_lag_seconds_bucket", le="0.25") == [2.0]
    assert sample(text, "gateway_event_loop_lag_seconds_bucket", le="0.5") == [3.0]
    assert sample(text, "gateway_event_loop_lag_seconds_sum") == [pytest.approx(0.4032)]
