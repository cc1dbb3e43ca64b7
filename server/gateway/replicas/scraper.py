"""The engines' own figures (KV-cache usage, queue, prefix cache): scraped from their `/metrics`.

Each engine's `/metrics` is scraped in the background, one asyncio task per engine, with a short
timeout, so a slow or dead engine delays nothing but its own next scrape. The text is parsed off
the event loop into `EngineMetrics` and written on the `Engine` (engine.py), where routing reads
it and the collector (collector.py) re-exports it as `gateway_engine_*`.

vLLM renames metrics between versions. Each value is looked up by its current name (and an older
one where there was a rename); a value the engine no longer exports is simply None, and a scrape
that fails for any reason marks the engine's metrics down (`Engine.metrics_up`) without raising.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.gateway.replicas.engine import Engine, EngineMetrics

log = logging.getLogger("gateway.engine_metrics")

# Our value -> the vLLM sample names that carry it, preferred first. Values of several data-parallel
# ranks of one engine (vLLM's own `engine` label) are summed, except the usage ratio (averaged).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
# Histograms' sums and counts only, never their buckets.
PREFILL_SECONDS = ("vllm:request_prefill_time_seconds_sum",)
FIRST_TOKEN_SECONDS = ("vllm:time_to_first_token_seconds_sum",)
FIRST_TOKENS = ("vllm:time_to_first_token_seconds_count",)
CACHE_CONFIG = "vllm:cache_config_info"

_WANTED = frozenset(
    (
        *KV_USAGE, *PREFIX_QUERIES, *PREFIX_HITS, *RUNNING, *WAITING, *PREEMPTIONS, *PREFILL_SECONDS,
        *FIRST_TOKEN_SECONDS, *FIRST_TOKENS, CACHE_CONFIG,
    )
)  # fmt: skip
# Line prefixes worth handing to the parser: our samples and their # TYPE/# HELP lines. The rest
# of a vLLM scrape (hundreds of histogram buckets) is skipped without being parsed.
_PREFIXES = tuple(sorted({n.removesuffix("_total") for n in _WANTED}))


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
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


def parse_engine_metrics(text: str) -> EngineMetrics:
    """The figures we keep, from the text of a vLLM `/metrics` page.

    Pure. Unknown or missing metrics are ignored; only text that is not the exposition format
    raises (ValueError)."""
    kept = "\n".join(line for line in text.splitlines() if _wanted_line(line))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    capacity: float | None = None
    block_size: int | None = None
    for family in text_string_to_metric_families(kept + "\n"):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG:
                value = _capacity(sample.labels)
                if value is not None:
                    capacity = (capacity or 0.0) + value
                size = _number(sample.labels.get("block_size"))
                if size is not None and size >= 1:
                    block_size = int(size)
            elif sample.name in _WANTED and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: Sequence[str], mean: bool = False) -> float | None:
        for name in names:
            if name in sums:
                return sums[name] / counts[name] if mean else sums[name]
        return None

    return EngineMetrics(
        kv_usage=first(KV_USAGE, mean=True),
        running=first(RUNNING),
        waiting=first(WAITING),
        prefix_queries_tokens=first(PREFIX_QUERIES),
        prefix_hits_tokens=first(PREFIX_HITS),
        preemptions=first(PREEMPTIONS),
        kv_capacity_tokens=capacity,
        block_size=block_size,
        prefill_seconds=first(PREFILL_SECONDS),
        first_token_seconds=first(FIRST_TOKEN_SECONDS),
        first_tokens=first(FIRST_TOKENS),
    )


class EngineMetricsScraper:
    """Scrapes every engine's `/metrics` in the background and writes the figures on the engine."""

    def __init__(
        self,
        engines: Iterable[Engine],
        *,
        client: httpx.AsyncClient,
        interval: float = 5.0,
        timeout: float = 2.0,
    ) -> None:
        self._engines = list(engines)
        self._client = client
        self._interval = interval
        # Each engine has one task doing one scrape at a time, so a hanging engine cannot pile up
        # scrapes; the timeout only bounds how long it takes to be shown as down.
        self._timeout = httpx.Timeout(timeout)
        self._tasks: dict[Engine, asyncio.Task[None]] = {}
        self._started = False

    async def start(self) -> None:
        """Start one background scraping task per engine; the first scrape starts at once."""
        if not self._started:
            self._started = True
            for engine in self._engines:
                self.add(engine)

    def add(self, engine: Engine) -> None:
        """Scrape one more engine (one found by DNS); its task starts now if scraping has started."""
        if engine not in self._engines:
            self._engines.append(engine)
        if self._started and engine not in self._tasks:
            self._tasks[engine] = asyncio.create_task(self._run(engine), name=f"scrape {engine.id}")

    def remove(self, engine: Engine) -> None:
        """Stop scraping an engine that left (its task is cancelled, not awaited)."""
        if engine in self._engines:
            self._engines.remove(engine)
        task = self._tasks.pop(engine, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        """Stop scraping; waits for the tasks to end."""
        tasks, self._tasks, self._started = list(self._tasks.values()), {}, False
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def scrape_once(self, engine: Engine) -> None:
        """Scrape one engine and record the result on it; never raises (except on cancellation)."""
        engine.scrapes += 1
        try:
            response = await self._client.get(engine.url + "/metrics", timeout=self._timeout)
            response.raise_for_status()
            metrics = await asyncio.to_thread(parse_engine_metrics, response.text)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means "down", never an error in the gateway
            if engine.metrics_up or engine.scrape_error is None:
                log.warning("engine %s: /metrics scrape failed: %r", engine.id, exc)
            engine.record_scrape_failure(repr(exc))
            return
        engine.record_scrape(metrics, at=time.time())  # a timestamp for Prometheus, not a latency

    async def _run(self, engine: Engine) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_once(engine)
            await asyncio.sleep(max(0.0, self._interval - (loop.time() - started)))
