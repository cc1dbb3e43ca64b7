"""The engines' own numbers (KV-cache usage, queue, prefix cache), re-exported by the gateway.

Each engine's `/metrics` is scraped in the background, one asyncio task per engine, with a short
timeout, so a slow or dead engine delays nothing but its own next scrape. The text is parsed off
the event loop into an `EngineSnapshot`; a custom Collector yields `gateway_engine_*` families from
the latest snapshots when Prometheus scrapes the gateway, without any I/O.

vLLM renames metrics between versions. Each value is looked up by its current name (and an older
one where there was a rename); a value the engine no longer exports is simply absent from our
output, and a scrape that fails for any reason marks the engine down (`gateway_engine_up` 0)
without raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("gateway.engine_metrics")

# Our value -> the vLLM sample names that carry it, preferred first. Values of several data-parallel
# ranks of one engine (vLLM's own `engine` label) are summed, except the usage ratio (averaged).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = frozenset(
    (*KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS, *RUNNING, *WAITING, *PREEMPTIONS, CACHE_CONFIG)
)
# Line prefixes worth handing to the parser: our samples and their # TYPE/# HELP lines. The rest
# of a vLLM scrape (hundreds of histogram buckets) is skipped without being parsed.
_PREFIXES = tuple(sorted({n.removesuffix("_total") for n in _WANTED}))


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One engine to scrape: the model it serves, its name in our labels, its base URL."""

    model: str
    engine: str
    url: str  # base URL without /v1, e.g. http://127.0.0.1:8100
    planned_kv_tokens: int | None = None  # the profile's plan, shown next to the actual capacity


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The values read from one good scrape; None where the engine did not export the value."""

    kv_usage_ratio: float | None = None
    prefix_queries_tokens: float | None = None
    prefix_hits_tokens: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    kv_capacity_tokens: float | None = None


def _number(text: str | None) -> float | None:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _capacity(labels: dict[str, str]) -> float | None:
    """KV capacity in tokens from one `vllm:cache_config_info` sample's labels."""
    tokens = _number(labels.get("kv_cache_size_tokens"))
    if tokens is not None:
        return tokens
    blocks, block_size = _number(labels.get("num_gpu_blocks")), _number(labels.get("block_size"))
    if blocks is not None and block_size is not None:
        return blocks * block_size
    return None


def _wanted_line(line: str) -> bool:
    if line.startswith("#"):  # "# TYPE name type" / "# HELP name text"
        parts = line.split(maxsplit=3)
        return len(parts) >= 3 and parts[2].startswith(_PREFIXES)
    return line.startswith(_PREFIXES)


def parse_engine_metrics(text: str) -> EngineSnapshot:
    """The values we re-export, from the text of a vLLM `/metrics` page.

    Pure. Unknown or missing metrics are ignored; only text that is not the exposition format
    raises (ValueError)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted_line(line))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    capacity: float | None = None
    for family in text_string_to_metric_families(kept + "\n"):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG:
                value = _capacity(sample.labels)
                if value is not None:
                    capacity = (capacity or 0.0) + value
            elif sample.name in _WANTED and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: Sequence[str], mean: bool = False) -> float | None:
        for name in names:
            if name in sums:
                return sums[name] / counts[name] if mean else sums[name]
        return None

    return EngineSnapshot(
        kv_usage_ratio=first(KV_USAGE, mean=True),
        prefix_queries_tokens=first(PREFIX_QUERIES),
        prefix_hits_tokens=first(PREFIX_HITS),
        running=first(RUNNING),
        waiting=first(WAITING),
        preemptions=first(PREEMPTIONS),
        kv_capacity_tokens=capacity,
    )


@dataclass(slots=True)
class _EngineState:
    target: ScrapeTarget
    up: bool = False
    snapshot: EngineSnapshot | None = None  # from the last good scrape; dropped when a scrape fails
    last_success: float | None = None  # unix time of the last good scrape
    last_error: str | None = None
    scrapes: int = 0  # attempts, good or bad


class EngineMetricsCollector(Collector):
    """Yields `gateway_engine_*` families from the latest snapshots; does no I/O."""

    def __init__(self, states: Iterable[_EngineState]):
        self._states = list(states)

    def describe(self) -> Iterator[Metric]:
        yield from self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(with_samples=True)

    def _families(self, with_samples: bool) -> Iterator[Metric]:
        labels = ["model", "engine"]
        up = GaugeMetricFamily(
            "gateway_engine_up",
            "1 if the engine's last /metrics scrape succeeded, else 0.",
            labels=labels,
        )
        last = GaugeMetricFamily(
            "gateway_engine_last_scrape_timestamp_seconds",
            "Unix time of the engine's last successful /metrics scrape.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "gateway_engine_kv_cache_usage_ratio",
            "KV-cache blocks in use, 0..1 (vllm:kv_cache_usage_perc; evictable cached blocks "
            "count as free).",
            labels=labels,
        )
        queries = CounterMetricFamily(
            "gateway_engine_prefix_cache_queries",
            "Prompt tokens looked up in the engine's prefix cache (vllm:prefix_cache_queries).",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "gateway_engine_prefix_cache_hits",
            "Prompt tokens found in the engine's prefix cache (vllm:prefix_cache_hits).",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "gateway_engine_requests_running",
            "Requests in the engine's running batch.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "gateway_engine_requests_waiting", "Requests queued in the engine.", labels=labels
        )
        preemptions = CounterMetricFamily(
            "gateway_engine_preemptions",
            "Requests the engine preempted (KV cache full).",
            labels=labels,
        )
        capacity = GaugeMetricFamily(
            "gateway_engine_kv_cache_capacity_tokens",
            "KV-cache capacity the engine reports, in tokens (vllm:cache_config_info).",
            labels=labels,
        )
        planned = GaugeMetricFamily(
            "gateway_engine_kv_cache_planned_tokens",
            "KV-cache capacity the engine's profile planned for, in tokens.",
            labels=labels,
        )
        if with_samples:
            for state in self._states:
                values = [state.target.model, state.target.engine]
                up.add_metric(values, 1.0 if state.up else 0.0)
                if state.last_success is not None:
                    last.add_metric(values, state.last_success)
                if state.target.planned_kv_tokens is not None:
                    planned.add_metric(values, float(state.target.planned_kv_tokens))
                snap = state.snapshot
                if snap is None:
                    continue
                for family, value in (
                    (usage, snap.kv_usage_ratio),
                    (queries, snap.prefix_queries_tokens),
                    (hits, snap.prefix_hits_tokens),
                    (running, snap.running),
                    (waiting, snap.waiting),
                    (preemptions, snap.preemptions),
                    (capacity, snap.kv_capacity_tokens),
                ):
                    if value is not None:
                        family.add_metric(values, value)
        yield from (up, last, usage, queries, hits, running, waiting, preemptions)
        yield from (capacity, planned)


class EngineMetricsScraper:
    """Scrapes every engine's `/metrics` in the background and re-exports it on `registry`."""

    def __init__(
        self,
        targets: Iterable[ScrapeTarget],
        *,
        client: httpx.AsyncClient,
        registry: CollectorRegistry,
        interval: float = 5.0,
        timeout: float = 2.0,
    ):
        self._client = client
        self._interval = interval
        # Each engine has one task doing one scrape at a time, so a hanging engine cannot pile up
        # scrapes; the timeout only bounds how long it takes to be shown as down.
        self._timeout = httpx.Timeout(timeout)
        self._states = [_EngineState(target) for target in targets]
        self._tasks: list[asyncio.Task] = []
        self.collector = EngineMetricsCollector(self._states)
        registry.register(self.collector)

    def state(self, engine: str) -> _EngineState:
        """The current state of one engine (for health views and tests)."""
        return next(s for s in self._states if s.target.engine == engine)

    async def start(self) -> None:
        """Start one background scraping task per engine; the first scrape starts at once."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._run(state), name=f"scrape {state.target.engine}")
                for state in self._states
            ]

    async def aclose(self) -> None:
        """Stop scraping; waits for the tasks to end."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def scrape_once(self, state: _EngineState) -> None:
        """Scrape one engine and update its state; never raises (except on cancellation)."""
        state.scrapes += 1
        try:
            url = state.target.url.rstrip("/") + "/metrics"
            response = await self._client.get(url, timeout=self._timeout)
            response.raise_for_status()
            snapshot = await asyncio.to_thread(parse_engine_metrics, response.text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure means "down", never an error in the gateway
            if state.up or state.last_error is None:
                log.warning("engine %s: /metrics scrape failed: %r", state.target.engine, exc)
            state.up, state.snapshot, state.last_error = False, None, repr(exc)
            return
        state.up, state.snapshot, state.last_error = True, snapshot, None
        state.last_success = time.time()  # a timestamp for Prometheus, not a latency

    async def _run(self, state: _EngineState) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_once(state)
            await asyncio.sleep(max(0.0, self._interval - (loop.time() - started)))
