"""Is the load generator itself the bottleneck? The event loop's lag, measured while a run goes.

A task asks to wake up every `interval_s` and records how late it woke. A loop that has more
callbacks ready than it can run in time (too many streams for one process, or a blocking call)
wakes it late, and every chunk timed on that loop is late by about as much. `saturation()`
turns the lag and the schedule into warnings for the report (thresholds in `Limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtest.metrics import percentile


@dataclass(frozen=True)
class Limits:
    """Where the generator stops being exact (the figures measured by `loadtest.selfcheck`)."""

    p99_loop_lag_ms: float = 5.0  # a lagging loop times every chunk late by about as much
    rate_shortfall: float = 0.05  # open loop: achieved send rate below target by more than this
    run_queue_wait_share: float = 0.10  # the generator was ready to run but had no CPU this often


class LoopLagMonitor:
    """Samples the running loop's lag every `interval_s` between `start()` and `stop()`."""

    def __init__(self, interval_s: float = 0.005, clock: Callable[[], float] = time.perf_counter) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._task: asyncio.Task | None = None
        self.lags_s: list[float] = []

    def start(self) -> None:
        self.lags_s = []
        self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            due = self._clock() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self.lags_s.append(max(0.0, self._clock() - due))

    async def stop(self) -> dict:
        """Stop sampling; returns `summary()`."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        return self.summary()

    def summary(self) -> dict:
        return lag_summary(self.lags_s)


def lag_summary(lags_s: Sequence[float]) -> dict:
    """`{median,p99,max}_loop_lag_ms` and `loop_lag_samples` (NaN without samples)."""
    result = {"loop_lag_samples": len(lags_s)}
    for stat, p in (("median", 50), ("p99", 99), ("max", 100)):
        result[f"{stat}_loop_lag_ms"] = percentile(lags_s, p) * 1000
    return result


def saturation(summary: dict, *, target_rate: float | None = None, limits: Limits = Limits()) -> list[str]:
    """Warnings when a run went past what the generator times exactly (empty when fine).

    `summary` holds `p99_loop_lag_ms`, `generator_run_queue_wait_share` (the share of the
    run the generator was ready to run but other processes held the CPU; `process_stats`) and,
    for open-loop runs, `achieved_rate` (session starts per second); pass `target_rate` only
    for open-loop runs without a concurrency ceiling (a ceiling slows the starts on purpose).
    """
    warnings = []
    lag = summary.get("p99_loop_lag_ms")
    if lag is not None and not math.isnan(lag) and lag > limits.p99_loop_lag_ms:
        warnings.append(
            f"the load generator was saturated: its event loop lagged {lag:.1f} ms at p99 "
            f"(limit {limits.p99_loop_lag_ms:g} ms; too much load for one process, or a busy "
            f"machine), so its latencies include its own delays; lower the concurrency or "
            f"rate, or run it where it gets a core of its own"
        )
    waited = summary.get("generator_run_queue_wait_share")
    if waited is not None and not math.isnan(waited) and waited > limits.run_queue_wait_share:
        warnings.append(
            f"the machine was busy: the load generator waited for a CPU {waited:.0%} of the run "
            f"(limit {limits.run_queue_wait_share:.0%}), so other processes' work shows up in its "
            f"latencies; give it a core of its own (taskset, nice) or run when the machine is quiet"
        )
    achieved = summary.get("achieved_rate")
    if (
        target_rate
        and achieved is not None
        and not math.isnan(achieved)
        and (achieved < target_rate * (1 - limits.rate_shortfall))
    ):
        warnings.append(
            f"the load generator fell behind its schedule: {achieved:.1f} requests/s sent "
            f"against {target_rate:g} targeted (more than {limits.rate_shortfall:.0%} short)"
        )
    return warnings
