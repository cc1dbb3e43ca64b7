"""One engine replica as the gateway knows it: where it is, its health, its load, its own figures.

Every fact about a replica lives on its `Engine`, written by the one part that learns it:
- the health checker (health.py): `healthy` and the check counters, `card` (its /v1/models entry);
  the proxy too, through `mark_down`, when a request cannot even connect;
- the pool (pool.py), on the request path: `outstanding`, taken and given back per request;
- the metrics scraper (scraper.py): `metrics` (KV usage, queue, prefix cache) and the scrape's own
  state (`metrics_up`, `scraped_at`, `scrape_error`, `scrapes`).
Routing (routing.py) and the Prometheus collector (collector.py) read the same objects. No I/O and
no clocks here: the writers pass in what they saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The engine's own figures from its last good /metrics scrape; None where it exported none.

    Gauges are as of that scrape; counters (queries, hits, preemptions) count since the engine
    started. Values of an engine's data-parallel ranks are summed (usage: averaged).
    """

    kv_usage: float | None = None  # KV-cache blocks in use, 0..1 (evictable cached blocks count as free)
    running: float | None = None  # requests in the running batch
    waiting: float | None = None  # requests queued
    prefix_queries_tokens: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens: float | None = None  # prompt tokens found there
    preemptions: float | None = None  # requests preempted because the KV cache was full
    kv_capacity_tokens: float | None = None  # KV-cache capacity the engine reports
    block_size: int | None = None  # tokens per KV-cache block (vllm:cache_config_info)
    # Over its life, for what a request costs it before its first token (service.py): seconds of
    # prefill (from scheduled to first token), and time to first token summed and counted.
    prefill_seconds: float | None = None
    first_token_seconds: float | None = None
    first_tokens: float | None = None


NO_METRICS = EngineMetrics()  # before the first good scrape, and after a failed one


@dataclass(eq=False, slots=True)
class Engine:
    """One engine replica: where it is, whether it is up, how busy it is, what it serves."""

    model: str
    url: str  # base URL without /v1, e.g. http://127.0.0.1:8100
    planned_kv_tokens: int | None = field(default=None, kw_only=True)  # the profile's plan, when known
    id: str = field(init=False)  # host:port, the `engine` label of our metrics

    # Health (health checker).
    healthy: bool = field(default=True, init=False)  # until the first check says otherwise
    checked: bool = field(default=False, init=False)
    failures: int = field(default=0, init=False)  # consecutive failed checks
    successes: int = field(default=0, init=False)  # consecutive good checks
    last_error: str | None = field(default=None, init=False)
    card: dict[str, object] | None = field(default=None, init=False)  # its /v1/models entry for `model`
    card_read_at: float = field(default=float("-inf"), init=False)  # time.monotonic() of the last /v1/models read
    adapters: dict[str, dict[str, object]] = field(default_factory=dict, init=False)  # LoRA: name -> card (adapters.py)
    adapter_changes: int = field(default=0, init=False)  # loads and unloads through this process

    # Load (pool): requests sent and not yet answered in full.
    outstanding: int = field(default=0, init=False)

    # Figures from the engine's /metrics (scraper).
    metrics: EngineMetrics = field(default=NO_METRICS, init=False)
    metrics_up: bool = field(default=False, init=False)  # the last scrape succeeded
    scraped_at: float | None = field(default=None, init=False)  # unix time of the last good scrape
    scrape_error: str | None = field(default=None, init=False)
    scrapes: int = field(default=0, init=False)  # attempts, good or bad

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.id = urlsplit(self.url).netloc or self.url

    def __repr__(self) -> str:
        state = "up" if self.healthy else "down"
        return f"<Engine {self.model}@{self.id} {state} outstanding={self.outstanding}>"

    @property
    def max_model_len(self) -> int | None:
        value = self.card.get("max_model_len") if self.card else None
        return value if isinstance(value, int) else None

    # -- health ----------------------------------------------------------------------------------

    def record_check(self, ok: bool, *, unhealthy_after: int, healthy_after: int, error: str | None = None) -> bool:
        """Count one health-check result; True when the engine's state changed."""
        before = self.healthy
        if ok:
            self.failures = 0
            self.successes += 1
            self.last_error = None
            if not self.checked or self.successes >= healthy_after:
                self.healthy = True
        else:
            self.successes = 0
            self.failures += 1
            self.last_error = error
            if not self.checked or self.failures >= unhealthy_after:
                self.healthy = False
        self.checked = True
        return self.healthy != before

    def mark_down(self, error: str) -> None:
        """A request could not even connect: stop sending traffic until a health check passes."""
        self.healthy = False
        self.successes = 0
        self.last_error = error

    # -- the engine's own figures ----------------------------------------------------------------

    def record_scrape(self, metrics: EngineMetrics, *, at: float) -> None:
        """A good scrape of /metrics at unix time `at`."""
        self.metrics, self.metrics_up, self.scrape_error = metrics, True, None
        self.scraped_at = at

    def record_scrape_failure(self, error: str) -> None:
        """A failed scrape: the figures are dropped (stale figures would mislead routing), the time stays."""
        self.metrics, self.metrics_up, self.scrape_error = NO_METRICS, False, error
