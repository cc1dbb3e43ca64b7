"""Optional reads of a vLLM `/metrics` endpoint (or the gateway's) while the load runs (`--metrics-url`).

The load tester stays an outside client; this only reads what the engine publishes. While a run
is in progress the endpoint is sampled every `interval_s` (and once more when a request's first
token arrives); each request is then credited with the highest KV-cache usage among the samples
taken while it was in flight, which gives the KV-cache usage per request and so per turn.
Scrapes before and after a run give counter deltas (prefix-cache hit rate, preemptions).
The tiny model answers in a few milliseconds once its prompt is processed, so short requests
may see no sample at all (their `engine` stays empty): use a shorter interval or more tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")
# The gateway re-exports the same engine figures under its own names (one series per engine), so
# `--metrics-url` may be the gateway's /metrics as well as an engine's.
GATEWAY_NAMES = {
    "gateway_engine_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "gateway_engine_requests_running": "vllm:num_requests_running",
    "gateway_engine_requests_waiting": "vllm:num_requests_waiting",
    "gateway_engine_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "gateway_engine_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "gateway_engine_preemptions_total": "vllm:num_preemptions_total",
}


def parse_metrics(text: str, names: tuple[str, ...] = GAUGES + COUNTERS) -> dict[str, float]:
    """Values of `names` in Prometheus text format, summed over label sets.

    `vllm:kv_cache_usage_perc` is a ratio, so it takes the maximum over label sets instead.
    Names missing from the text are missing from the result. The gateway's `gateway_engine_*`
    re-exports count as the vLLM names they come from (`GATEWAY_NAMES`).
    """
    wanted = set(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        name = GATEWAY_NAMES.get(name, name)
        if name not in wanted:
            continue
        if "{" in name_part and "}" not in name_part:
            # a label value with spaces: the value is after the closing brace
            rest = line[line.index("}") + 1 :]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isnan(value):
            continue
        if name == "vllm:kv_cache_usage_perc":
            values[name] = max(values.get(name, 0.0), value)
        else:
            values[name] = values.get(name, 0.0) + value
    return values


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increases over a run, plus `prefix_cache_hit_rate` = hits / queries (0..1)."""
    deltas = {name.removeprefix("vllm:"): after[name] - before.get(name, 0.0) for name in COUNTERS if name in after}
    queries = deltas.get("prefix_cache_queries_total")
    if queries:
        deltas["prefix_cache_hit_rate"] = deltas.get("prefix_cache_hits_total", 0.0) / queries
    return deltas


@dataclass(frozen=True)
class Sample:
    """One scrape: when it started and ended (run clock, seconds) and the values read."""

    start: float
    end: float
    values: dict[str, float]


class EngineProbe:
    """Scrapes one `/metrics` URL: on demand, and periodically while sampling is on."""

    def __init__(
        self,
        url: str,
        *,
        http: httpx.AsyncClient,
        timeout_s: float = 5.0,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.url = url
        self._http = http
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._clock = clock
        self._inflight: asyncio.Task | None = None
        self._sampler: asyncio.Task | None = None
        self._origin = 0.0
        self.samples: list[Sample] = []
        self.failures = 0

    async def scrape(self) -> dict[str, float] | None:
        """The current values, or None when the endpoint did not answer."""
        try:
            response = await self._http.get(self.url, timeout=self._timeout_s)
            response.raise_for_status()
        except httpx.HTTPError:
            self.failures += 1
            return None
        return parse_metrics(response.text)

    async def _sample_once(self) -> None:
        start = self._clock() - self._origin
        values = await self.scrape()
        if values is not None:
            self.samples.append(Sample(start, self._clock() - self._origin, values))

    def sample(self) -> asyncio.Task:
        """Take a sample now, unless one is already in flight (then share that one)."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._sample_once())
        return self._inflight

    def start_sampling(self, origin: float) -> None:
        """Sample every `interval_s` from now on; sample times are relative to `origin`."""
        self._origin = origin
        self.samples = []

        async def loop() -> None:
            while True:
                await self.sample()
                await asyncio.sleep(self._interval_s)

        self._sampler = asyncio.ensure_future(loop())

    async def stop_sampling(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None
        if self._inflight is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._inflight


def during(samples: list[Sample], start: float, end: float) -> dict[str, float] | None:
    """The values of the sample with the highest KV-cache usage overlapping [start, end]."""
    overlapping = [s for s in samples if s.end >= start and s.start <= end]
    if not overlapping:
        return None
    best = max(overlapping, key=lambda s: s.values.get("vllm:kv_cache_usage_perc", 0.0))
    return best.values
