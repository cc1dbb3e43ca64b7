"""Where tenants' quota counters live: one interface, three stores (docs/operate/quotas.md).

    MemoryCounters   this process only: one gateway process (`--workers 1`), unit tests
    HostCounters     one file the supervisor creates, mapped by every worker of `--workers N`
                     (tenants.counters_host): one set of counters per host, nothing to install
    RedisCounters    a Redis server shared by gateway replicas (tenants.counters_redis)

A store keeps, per tenant, two token buckets (requests and tokens: a level and when it was last
refilled) and the requests in flight, and answers one question atomically: may this request in,
taking one request and `reserve` tokens (`take`), and later `release` its concurrency slot and
settle its tokens. The arithmetic is `decide` below, shared by the local stores and written
again in Lua for Redis (the same cases in the same order, tested against each other). The local
stores answer synchronously too (`take_now`), for callers without an event loop.

`Outcome.verdict` is OK, one of the refusals (CONCURRENT, TOO_LARGE, REQUESTS, TOKENS), or
UNCHECKED: the store could not be asked (Redis unreachable) and the request is let in without a
quota (fail open: counted in `gateway_quota_unchecked_total` and logged, tenants.counters_redis).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from server.gateway.settings import GatewaySettings, QuotaStore, TenantLimits

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("gateway")

Clock = Callable[[], float]

# Outcome.verdict
OK = "ok"
CONCURRENT = "concurrent"
TOO_LARGE = "too_large"
REQUESTS = "requests"
TOKENS = "tokens"
UNCHECKED = "unchecked"
CONCURRENT_RETRY = 1.0  # seconds a client refused for concurrency is told to wait


class QuotaStoreUnavailable(RuntimeError):
    """The configured store cannot be used at start (the reason; never a URL's password)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits as the stores read them: 0 where a limit is absent."""

    requests: int
    tokens: int
    concurrent: int
    window: float

    @property
    def any(self) -> bool:
        return bool(self.requests or self.tokens or self.concurrent)

    @classmethod
    def of(cls, limits: TenantLimits) -> Limits:
        return cls(
            limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.max_concurrent or 0,
            limits.window_seconds,
        )  # fmt: skip


@dataclass(slots=True)
class Outcome:
    """A store's answer to `take`: the verdict, seconds to wait (refusals that waiting cures), the
    buckets' levels after it (NaN: no such bucket, or unchecked), and what `release` needs back."""

    verdict: str
    wait: float = 0.0
    requests: float = math.nan
    tokens: float = math.nan
    slot: object = None


class CounterStore(Protocol):
    """What Quota asks of a store (see the module doc); `key` is the tenant's name."""

    async def take(self, key: str, limits: Limits, reserve: int) -> Outcome: ...

    def release(self, key: str, limits: Limits, slot: object, delta: int | None) -> None:
        """The request ended: free its slot (if it held one) and add `delta` tokens to what it
        took (used minus reserved; None: the reservation stands)."""

    async def aclose(self) -> None: ...


# -- the arithmetic ------------------------------------------------------------------------------

# A tenant's buckets as four floats: requests level, its time, tokens level, its time. A time
# below 0 means never touched: the bucket is full.
State = list[float]


def fresh_state() -> State:
    return [0.0, -1.0, 0.0, -1.0]


def _refill(state: State, at: int, limit: int, window: float, now: float) -> None:
    if state[at + 1] < 0:
        state[at], state[at + 1] = float(limit), now
    elif now > state[at + 1]:
        state[at] = min(float(limit), state[at] + (now - state[at + 1]) * limit / window)
        state[at + 1] = now


def refill(state: State, limits: Limits, now: float) -> None:
    if limits.requests:
        _refill(state, 0, limits.requests, limits.window, now)
    if limits.tokens:
        _refill(state, 2, limits.tokens, limits.window, now)


def decide(state: State, limits: Limits, reserve: int, in_flight: int, now: float) -> Outcome:
    """Refill the buckets to `now`, then admit (taking one request and `reserve` tokens) or refuse;
    `in_flight` is the tenant's requests in flight everywhere the store counts."""
    requests, tokens, window = limits.requests, limits.tokens, limits.window
    # (refill and levels, inlined: this runs for every request of a tenant with limits)
    asked = level = math.nan  # the buckets' levels (NaN: no such bucket)
    if requests:
        asked, last = state[0], state[1]
        if last < 0:
            asked = float(requests)
        elif now > last:
            asked = min(float(requests), asked + (now - last) * requests / window)
        state[1] = now if now > last else last
    if tokens:
        level, last = state[2], state[3]
        if last < 0:
            level = float(tokens)
        elif now > last:
            level = min(float(tokens), level + (now - last) * tokens / window)
        state[3] = now if now > last else last
    verdict, wait = OK, 0.0
    if limits.concurrent and in_flight >= limits.concurrent:
        verdict, wait = CONCURRENT, CONCURRENT_RETRY
    elif tokens and reserve > tokens:
        verdict = TOO_LARGE
    else:
        if requests and asked < 1:
            verdict, wait = REQUESTS, (1 - asked) * window / requests
        if tokens and level < reserve:
            need = (reserve - level) * window / tokens
            if need > wait:
                verdict, wait = TOKENS, need
        if verdict == OK:
            asked -= 1  # (NaN stays NaN)
            level -= reserve
    if requests:
        state[0] = asked
    if tokens:
        state[2] = level
    return Outcome(verdict, wait, asked, level)


def settle(state: State, limits: Limits, delta: int | None, now: float) -> None:
    """Charge `delta` more tokens (negative: give some back), never above the bucket's limit."""
    tokens = limits.tokens
    if tokens and delta is not None:
        level, last = state[2], state[3]
        if last < 0:  # (the refill, inlined)
            level, state[3] = float(tokens), now
        elif now > last:
            level = min(float(tokens), level + (now - last) * tokens / limits.window)
            state[3] = now
        state[2] = min(float(tokens), level - delta)


def levels(state: State, limits: Limits) -> tuple[float, float]:
    return (state[0] if limits.requests else math.nan, state[2] if limits.tokens else math.nan)


# -- this process only ---------------------------------------------------------------------------


class MemoryCounters:
    """Every tenant's counters in this process's memory (one gateway process, unit tests)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, State] = {}
        self.in_flight: dict[str, int] = {}

    def take_now(self, key: str, limits: Limits, reserve: int) -> Outcome:
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = fresh_state()
        in_flight = self.in_flight.get(key, 0)
        outcome = decide(state, limits, reserve, in_flight, self.clock())
        if outcome.verdict == OK:
            self.in_flight[key] = in_flight + 1
        return outcome

    async def take(self, key: str, limits: Limits, reserve: int) -> Outcome:
        return self.take_now(key, limits, reserve)

    def release(self, key: str, limits: Limits, slot: object, delta: int | None) -> None:
        self.in_flight[key] = max(0, self.in_flight.get(key, 0) - 1)
        if limits.tokens and delta is not None:
            state = self.states.get(key)
            if state is None:
                state = self.states[key] = fresh_state()
            settle(state, limits, delta, self.clock())

    def peek(self, key: str, limits: Limits) -> tuple[float, float]:
        """The buckets' levels as of now, changing nothing but the refill."""
        state = self.states.setdefault(key, fresh_state())
        refill(state, limits, self.clock())
        return levels(state, limits)

    async def aclose(self) -> None:
        pass


# -- which store ---------------------------------------------------------------------------------


async def open_store(
    config: QuotaStore, names: Sequence[str], environ: Mapping[str, str], registry: CollectorRegistry | None = None
) -> CounterStore:
    """The counter store of `config`: Redis (its URL from `config.redis_url_env`; QuotaStoreUnavailable
    if it cannot be reached), else the host's file when a supervisor made one (`--workers N`), else
    this process's memory."""
    from server.gateway.tenants.counters_host import QUOTA_FILE_ENV, WORKER_INDEX_ENV, HostCounters

    if config.backend == "redis":
        from server.gateway.tenants.counters_redis import RedisCounters, check_redis, redis_url

        url = redis_url(config, environ)
        await check_redis(url)
        store = RedisCounters(url, unchecked=_unchecked_counter(registry))
        log.info("quota store: Redis at %s", store.where)
        return store
    if QUOTA_FILE_ENV in environ:
        return HostCounters(environ[QUOTA_FILE_ENV], names, int(environ.get(WORKER_INDEX_ENV, "0")))
    return MemoryCounters()


def _unchecked_counter(registry: CollectorRegistry | None) -> Callable[[str], None]:
    """`gateway_quota_unchecked_total{tenant}`: requests let in without a quota (store unreachable)."""
    from prometheus_client import Counter, values

    multiprocess = getattr(values.ValueClass, "_multiprocess", False)
    if registry is None and not multiprocess:
        return lambda tenant: None
    counter = Counter(
        "gateway_quota_unchecked",
        "Requests let in without a quota check because the quota store (Redis) was unreachable (fail open).",
        ["tenant"],
        registry=None if multiprocess else registry,
    )
    return lambda tenant: counter.labels(tenant).inc()


async def check_quota_store(settings: GatewaySettings, environ: Mapping[str, str] | None = None) -> None:
    """Before any worker starts: QuotaStoreUnavailable when the counters are to be in Redis (and some
    tenant has limits) but its URL is not given or its server does not answer."""
    limited = any(Limits.of(tenant.limits).any for tenant in settings.tenants or ())
    if settings.quota_store.backend != "redis" or not limited:
        return
    from server.gateway.tenants.counters_redis import check_redis, redis_url

    await check_redis(redis_url(settings.quota_store, os.environ if environ is None else environ))
