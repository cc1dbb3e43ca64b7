"""The overload warning: event-loop lag and open-loop shortfall, pure and against the stand-in."""

import math
import time

import pytest

from loadtest import scenarios
from loadtest.client import ChatClient, make_transport
from loadtest.console import console_table
from loadtest.loop_lag import Limits, LoopLagMonitor, lag_summary, saturation
from loadtest.report import RunOutcome, markdown
from loadtest.runner import LoadShape, Runner, StopRule


def test_lag_summary_in_milliseconds():
    summary = lag_summary([0.001, 0.002, 0.010])
    assert summary["loop_lag_samples"] == 3
    assert summary["median_loop_lag_ms"] == pytest.approx(2.0)
    assert summary["max_loop_lag_ms"] == pytest.approx(10.0)
    assert math.isnan(lag_summary([])["p99_loop_lag_ms"])


def test_saturation_warns_above_the_limits_only():
    assert saturation({"p99_loop_lag_ms": 4.9}) == []
    (warning,) = saturation({"p99_loop_lag_ms": 5.1})
    assert "saturated" in warning and "5.1 ms" in warning
    assert saturation({"p99_loop_lag_ms": math.nan}) == []
    # open loop: more than 5 % short of the target rate
    assert saturation({"achieved_rate": 95.5}, target_rate=100) == []
    (warning,) = saturation({"achieved_rate": 94.0}, target_rate=100)
    assert "behind its schedule" in warning
    assert saturation({"achieved_rate": 10.0}) == []  # no target (closed loop, ceiling)
    assert (
        len(
            saturation(
                {"p99_loop_lag_ms": 2.0, "achieved_rate": 50.0}, target_rate=100, limits=Limits(p99_loop_lag_ms=1.0)
            )
        )
        == 2
    )


async def test_monitor_sees_a_blocked_loop():
    monitor = LoopLagMonitor(interval_s=0.002)
    monitor.start()
    for _ in range(3):
        await _until_sampled(monitor)
        time.sleep(0.030)  # noqa: ASYNC251 -- blocks the loop on purpose
    summary = await monitor.stop()
    assert summary["max_loop_lag_ms"] >= 25.0


async def _until_sampled(monitor):
    """Yield to the loop until the monitor took one more sample (generous deadline)."""
    import asyncio

    count = len(monitor.lags_s)
    deadline = time.monotonic() + 30
    while len(monitor.lags_s) == count and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    assert len(monitor.lags_s) > count


async def run_blocked(url, shape, stop, block_s):
    """A run whose every finished request blocks the generator's loop for `block_s`."""
    async with make_transport("raw", max_connections=32, timeout_s=10) as http:
        client = ChatClient(url, http=http, model="standin", timeout_s=10)
        sessions = scenarios.random_prompts(0, input_chars=40, max_tokens=2)
        return await Runner(client, sessions, shape, stop, on_record=lambda record: time.sleep(block_s)).run()


async def test_overload_warning_fires_when_the_generator_is_saturated(standin):
    result = await run_blocked(standin, LoadShape(concurrency=8), StopRule(num_requests=24), 0.03)
    outcome = RunOutcome.of(result, standin, {})
    assert outcome.summary["p99_loop_lag_ms"] > 5.0
    warnings = outcome.summary["generator_warnings"]
    assert any("saturated" in w for w in warnings)
    assert "WARNING" in console_table([outcome], [])
    assert "the load generator was the bottleneck" in markdown([outcome], [], {}, [])


async def test_open_loop_shortfall_warning(standin):
    # 50 sessions/s targeted, but each finished request blocks the loop 50 ms: at most 20/s once
    # answers come back. A 1.2 s schedule (60 sessions) outlasts the first answers even when they
    # are slow on a busy machine (the stand-in runs in this process; with 30 sessions at 200/s, a
    # 0.15 s schedule, runs whose first answers came late kept 190/s: nothing had blocked the loop yet).
    result = await run_blocked(standin, LoadShape(rate=50, arrival="constant"), StopRule(num_requests=60), 0.05)
    outcome = RunOutcome.of(result, standin, {})
    assert outcome.summary["achieved_rate"] < 47.5  # 0.95 of the target, as the old bound was
    assert any("behind its schedule" in w for w in outcome.summary["generator_warnings"])


async def test_no_warning_fields_missing_on_a_normal_run(standin):
    async with make_transport("raw", max_connections=2, timeout_s=10) as http:
        client = ChatClient(standin, http=http, model="standin", timeout_s=10)
        result = await Runner(
            client,
            scenarios.random_prompts(0, input_chars=40, max_tokens=2),
            LoadShape(concurrency=1),
            StopRule(num_requests=3),
        ).run()
    outcome = RunOutcome.of(result, standin, {})
    assert outcome.summary["loop_lag_samples"] > 0
    assert outcome.summary["p99_loop_lag_ms"] >= 0
    assert isinstance(outcome.summary["generator_warnings"], list)
