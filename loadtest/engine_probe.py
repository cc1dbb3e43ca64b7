"""Optional reads of a vLLM `/metrics` endpoint while the load runs (`--metrics-url`).

The load tester stays an outside client; this only reads what the engine publishes. One scrape
per request, fired when its first token arrives (the moment its prompt's KV blocks are all
allocated), gives the KV-cache usage per request and so per turn; scrapes before and after a
run give counter deltas (prefix-cache hit rate, preemptions). A scrape in flight is never
doubled: a request whose first token arrives meanwhile shares that scrape's result.
"""

from __future__ import annotations

import asyncio
import math

import httpx

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:num_preemptions_total")


def parse_metrics(text: str, names: tuple[str, ...] = GAUGES + COUNTERS) -> dict[str, float]:
    """Values of `names` in Prometheus text format, summed over label sets.

    `vllm:kv_cache_usage_perc` is a ratio, so it takes the maximum over label sets instead.
    Names missing from the text are missing from the result.
    """
    wanted = set(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        if name not in wanted:
            continue
        if "{" in name_part and "}" not in name_part:
            # a label value with spaces: the value is after the closing brace
            rest = line[line.index("}") + 1:]
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
    deltas = {name.removeprefix("vllm:"): after[name] - before.get(name, 0.0)
              for name in COUNTERS if name in after}
    queries = deltas.get("prefix_cache_queries_total")
    if queries:
        deltas["prefix_cache_hit_rate"] = deltas.get("prefix_cache_hits_total", 0.0) / queries
    return deltas


class EngineProbe:
    """Scrapes one `/metrics` URL on demand with its own short timeout."""

    def __init__(self, url: str, *, http: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
        self.url = url
        self._http = http
        self._timeout_s = timeout_s
        self._inflight: asyncio.Task | None = None
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

    def sample(self) -> asyncio.Task:
        """A task resolving to a scrape; shares the one in flight if there is one."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self.scrape())
        return self._inflight
