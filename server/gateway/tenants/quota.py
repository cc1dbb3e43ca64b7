"""A tenant's quotas: requests and tokens per window as token buckets, and concurrent requests.

Each budget is a bucket of `limit` that refills continuously at `limit / window` per second (as
OpenAI's limits replenish), so a tenant that waits `Retry-After` seconds always gets in, and there
is no burst of 2x at a window's edge as with fixed windows. A request takes one from the requests
bucket and its reservation from the tokens bucket: the prompt's estimate (`reservation`) plus the
completion's cap (`max_tokens`, `max_completion_tokens` or `max_output_tokens`; none: nothing is
reserved for it). When it ends, `Ticket.settle` charges what the engine's `usage` says instead;
the bucket may go below zero (a long answer's debt), which later requests wait out. No I/O, and
the clock is injected (`time.monotonic` by default): tests drive it by hand.

The levels and the requests in flight live in a counter store (tenants.counters): this
process's memory, a file shared by the `--workers` of one host, or Redis shared by replicas;
this module is the fixed side (limits, headers, the refusals' words).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from server.gateway.settings import TenantLimits
from server.gateway.tenants.counters import (
    CONCURRENT,
    OK,
    REQUESTS,
    TOO_LARGE,
    UNCHECKED,
    CounterStore,
    Limits,
    MemoryCounters,
    Outcome,
)
from server.gateway.tenants.errors import QuotaExceeded

Clock = Callable[[], float]


@runtime_checkable
class HostLike(Protocol):
    """A local store: answers at once, without an event loop."""

    def take_now(self, key: str, limits: Limits, reserve: int) -> Outcome: ...

    def peek(self, key: str, limits: Limits) -> tuple[float, float]: ...


Headers = list[tuple[bytes, bytes]]
CHARS_PER_TOKEN = 4  # a prompt's estimate before the engine counts it: bytes of the body over this


def reservation(completion_cap: int | None, raw_length: int) -> int:
    """Tokens to reserve for a request: the prompt's estimate (`raw_length`, its body's bytes) plus
    its completion cap, if any (request.output_cap)."""
    return raw_length // CHARS_PER_TOKEN + 1 + (completion_cap or 0)


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


class Budget:
    """One bucket's fixed side: `limit` units refilling at `limit / window` per second; its level
    lives in the counter store (tenants.counters) and may go negative (debt). Its headers' names
    and its limit's header are made once (Quota.headers writes the levels)."""

    __slots__ = ("limit", "rate", "limit_header", "remaining_name", "reset_name")

    def __init__(self, limit: int, window: float, kind: bytes = b"") -> None:
        self.limit = limit
        self.rate = limit / window
        self.limit_header = (b"x-ratelimit-limit-" + kind, str(limit).encode())  # the same on every answer
        self.remaining_name = b"x-ratelimit-remaining-" + kind
        self.reset_name = b"x-ratelimit-reset-" + kind

    def reset(self, level: float) -> float:
        """Seconds until the bucket is full again (OpenAI's `reset`)."""
        return max(0.0, (self.limit - level) / self.rate)


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on its tenant's quota, settled once when it ends."""

    quota: Quota
    reserved: int
    slot: object = None  # the store's handle on its concurrency slot
    checked: bool = True  # False: let in unchecked (the store was unreachable): nothing to settle
    settled: bool = field(default=False)
    requests: float = math.nan  # the buckets' levels after this request (its answer's headers)
    tokens: float = math.nan

    def headers(self) -> Headers:
        """The answer's `x-ratelimit-*` headers, as of this request (none when it went in unchecked)."""
        return self.quota.headers(self.requests, self.tokens) if self.checked else []

    def settle(self, used: int | None) -> None:
        """The request ended: free its concurrency slot and charge `used` tokens instead of the
        reservation (None: the engine reported no usage; the reservation stands)."""
        if self.settled:
            return
        self.settled = True
        if self.checked:
            quota = self.quota
            quota.store.release(quota.key, quota.limits, self.slot, None if used is None else used - self.reserved)


class Quota:
    """One tenant's quotas (see the module doc) over a counter store; `enter` (or, with a local
    store, `admit`) is the only way in."""

    def __init__(
        self, limits: TenantLimits, clock: Clock = time.monotonic, *, store: CounterStore | None = None, key: str = ""
    ) -> None:
        self.limits = Limits.of(limits)
        window = limits.window_seconds
        self.requests = Budget(limits.requests_per_minute, window, b"requests") if limits.requests_per_minute else None
        self.tokens = Budget(limits.tokens_per_minute, window, b"tokens") if limits.tokens_per_minute else None
        self.max_concurrent = limits.max_concurrent
        self.store = store if store is not None else MemoryCounters(clock)
        self.key = key  # the tenant's name: its counters in the store

    @property
    def store(self) -> CounterStore:
        return self._store

    @store.setter
    def store(self, store: CounterStore) -> None:
        self._store = store
        # A local store answers at once: `admit` asks it without an event loop, and `enter`
        # without awaiting (tenants.counters).
        self._take_now = store.take_now if isinstance(store, HostLike) else None
        self.local = self._take_now is not None

    @property
    def limited(self) -> bool:
        """Whether any limit applies (a tenant without limits needs no quota at all)."""
        return self.requests is not None or self.tokens is not None or self.max_concurrent is not None

    def headers(self, requests: float | None = None, tokens: float | None = None) -> Headers:
        """OpenAI's `x-ratelimit-*` headers for the buckets there are, at these levels (None: as of
        now, from a local store)."""
        if requests is None or tokens is None:
            requests, tokens = self._local().peek(self.key, self.limits)
        out: Headers = []  # (one loop, no call per bucket: this runs for every answer)
        for budget, level in ((self.requests, requests), (self.tokens, tokens)):
            if budget is not None:
                wait = (budget.limit - level) / budget.rate
                out.append(budget.limit_header)
                out.append((budget.remaining_name, b"%d" % level if level > 0 else b"0"))  # (%d of a float: its floor)
                if 0 < wait < 1:
                    out.append((budget.reset_name, b"%dms" % -(-wait * 1000 // 1)))  # (milliseconds, rounded up)
                else:
                    out.append((budget.reset_name, format_reset(wait).encode()))
        return out

    def admit(self, reserve: int) -> tuple[Ticket, Headers]:
        """`enter` without an event loop, for a local store (`local`: tenants.counters)."""
        ticket = self.take(reserve)
        return ticket, ticket.headers()

    def take(self, reserve: int) -> Ticket:
        """`admit` without the headers, which the ticket makes when asked (`Ticket.headers`): the
        request path asks once the engine has the request, and makes them while it works. A call
        (not a coroutine, as `enter`): a local store answers at once."""
        take_now = self._take_now
        if take_now is None:
            raise RuntimeError("this quota's counters are remote: use `await quota.enter(...)`")
        outcome = take_now(self.key, self.limits, reserve)
        if outcome.verdict == OK:  # (`_answer`'s first case: the path of every request within its quota)
            return Ticket(self, reserve, outcome.slot, requests=outcome.requests, tokens=outcome.tokens)
        return self._answer(outcome, reserve)[0]  # (a refusal raises)

    async def enter(self, reserve: int) -> tuple[Ticket, Headers]:
        """Take one request and `reserve` tokens, or raise QuotaExceeded (with Retry-After when
        waiting helps); also the rate-limit headers of the answer, after this request (none when
        the store could not be asked: the request goes in unchecked)."""
        take_now = self._take_now
        if take_now is not None:
            return self._answer(take_now(self.key, self.limits, reserve), reserve)
        return self._answer(await self._store.take(self.key, self.limits, reserve), reserve)

    def _answer(self, outcome: Outcome, reserve: int) -> tuple[Ticket, Headers]:
        verdict = outcome.verdict
        if verdict == OK:
            ticket = Ticket(self, reserve, outcome.slot, requests=outcome.requests, tokens=outcome.tokens)
            return ticket, ticket.headers()
        if verdict == UNCHECKED:
            return Ticket(self, reserve, checked=False), []
        headers = self.headers(outcome.requests, outcome.tokens)
        if verdict == CONCURRENT:
            message = f"Too many concurrent requests: the limit is {self.max_concurrent}."
        elif verdict == TOO_LARGE:
            assert self.tokens is not None
            raise QuotaExceeded(
                f"Request too large for the tokens per minute limit: limit {self.tokens.limit}, requested "
                f"about {reserve} (prompt estimate and completion cap); send fewer or lower max_tokens.",
                headers=headers,
            )
        elif verdict == REQUESTS:
            assert self.requests is not None
            what = f"requests per minute: limit {self.requests.limit}"
            message = f"Rate limit reached for {what}. Try again in {format_reset(outcome.wait)}."
        else:
            assert self.tokens is not None
            what = f"tokens per minute: limit {self.tokens.limit}, requested about {reserve}"
            message = f"Rate limit reached for {what}. Try again in {format_reset(outcome.wait)}."
        wait = outcome.wait
        retry = [
            (b"retry-after", str(max(1, math.ceil(wait))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(wait * 1000))).encode()),
        ]
        raise QuotaExceeded(message, headers=[*retry, *headers])

    def _local(self) -> HostLike:
        store = self.store
        if not isinstance(store, HostLike):
            raise RuntimeError("this quota's counters are remote: use `await quota.enter(...)`")
        return store
