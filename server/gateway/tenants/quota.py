"""A tenant's quotas: requests and tokens per window as token buckets, and concurrent requests.

Each budget is a bucket of `limit` that refills continuously at `limit / window` per second (as
OpenAI's limits replenish), so a tenant that waits `Retry-After` seconds always gets in, and there
is no burst of 2x at a window's edge as with fixed windows. A request takes one from the requests
bucket and its reservation from the tokens bucket: the prompt's estimate (`reservation`) plus the
completion's cap (`max_tokens`, `max_completion_tokens` or `max_output_tokens`; none: nothing is
reserved for it). When it ends, `Ticket.settle` charges what the engine's `usage` says instead;
the bucket may go below zero (a long answer's debt), which later requests wait out. No I/O, and
the clock is injected (`time.monotonic` by default): tests drive it by hand.

The counters are this process's: with `--workers N` or several gateway replicas each has its own
(shared counters, Redis, are a later step: docs/configure/tenants.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.gateway.settings import TenantLimits
from server.gateway.tenants.errors import QuotaExceeded

Clock = Callable[[], float]
Headers = list[tuple[bytes, bytes]]
CHARS_PER_TOKEN = 4  # a prompt's estimate before the engine counts it: bytes of the body over this
_COMPLETION_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def reservation(body: dict[str, Any], raw_length: int) -> int:
    """Tokens to reserve for a request: the prompt's estimate plus its completion cap, if any."""
    completion = 0
    for name in _COMPLETION_CAPS:
        value = body.get(name)
        if type(value) is int and value > 0:
            completion = value
            break
    return raw_length // CHARS_PER_TOKEN + 1 + completion


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


class Bucket:
    """`limit` units refilling at `limit / window` per second; `level` may go negative (debt)."""

    __slots__ = ("at", "level", "limit", "limit_text", "rate")

    def __init__(self, limit: int, window: float, now: float) -> None:
        self.limit = limit
        self.limit_text = str(limit).encode()
        self.rate = limit / window
        self.level = float(limit)
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(float(self.limit), self.level + (now - self.at) * self.rate)
            self.at = now

    def wait(self, amount: float) -> float:
        """Seconds until `amount` is there (0: now)."""
        return max(0.0, (amount - self.level) / self.rate)

    def reset(self) -> float:
        """Seconds until the bucket is full again (OpenAI's `reset`)."""
        return max(0.0, (self.limit - self.level) / self.rate)

    def headers(self, kind: bytes) -> Headers:
        return [
            (b"x-ratelimit-limit-" + kind, self.limit_text),
            (b"x-ratelimit-remaining-" + kind, str(max(0, math.floor(self.level))).encode()),
            (b"x-ratelimit-reset-" + kind, format_reset(self.reset()).encode()),
        ]


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on its tenant's quota, settled once when it ends."""

    quota: Quota
    reserved: int
    settled: bool = field(default=False)

    def settle(self, used: int | None) -> None:
        """The request ended: free its concurrency slot and charge `used` tokens instead of the
        reservation (None: the engine reported no usage; the reservation stands)."""
        if self.settled:
            return
        self.settled = True
        quota = self.quota
        quota.in_flight -= 1
        tokens = quota.tokens
        if tokens is not None and used is not None:
            tokens.level = min(float(tokens.limit), tokens.level - (used - self.reserved))


class Quota:
    """One tenant's quotas (see the module doc); `admit` is the only way in."""

    def __init__(self, limits: TenantLimits, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        now = clock()
        window = limits.window_seconds
        self.requests = Bucket(limits.requests_per_minute, window, now) if limits.requests_per_minute else None
        self.tokens = Bucket(limits.tokens_per_minute, window, now) if limits.tokens_per_minute else None
        self.max_concurrent = limits.max_concurrent
        self.in_flight = 0

    @property
    def limited(self) -> bool:
        """Whether any limit applies (a tenant without limits needs no quota at all)."""
        return self.requests is not None or self.tokens is not None or self.max_concurrent is not None

    def headers(self) -> Headers:
        """OpenAI's `x-ratelimit-*` headers for the buckets there are, as of now."""
        out: Headers = []
        if self.requests is not None:
            out += self.requests.headers(b"requests")
        if self.tokens is not None:
            out += self.tokens.headers(b"tokens")
        return out

    def admit(self, reserve: int) -> tuple[Ticket, Headers]:
        """Take one request and `reserve` tokens, or raise QuotaExceeded (with Retry-After when
        waiting helps); also the rate-limit headers of the answer, after this request."""
        now = self.clock()
        requests, tokens = self.requests, self.tokens
        if requests is not None:
            requests.refill(now)
        if tokens is not None:
            tokens.refill(now)
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            raise self._refused(f"Too many concurrent requests: the limit is {self.max_concurrent}.", 1.0)
        if tokens is not None and reserve > tokens.limit:
            raise QuotaExceeded(
                f"Request too large for the tokens per minute limit: limit {tokens.limit}, requested "
                f"about {reserve} (prompt estimate and completion cap); send fewer or lower max_tokens.",
                headers=self.headers(),
            )
        wait = 0.0
        what = ""
        if requests is not None and (w := requests.wait(1)) > 0:
            wait, what = w, f"requests per minute: limit {requests.limit}"
        if tokens is not None and (w := tokens.wait(reserve)) > wait:
            wait, what = w, f"tokens per minute: limit {tokens.limit}, requested about {reserve}"
        if wait > 0:
            raise self._refused(f"Rate limit reached for {what}. Try again in {format_reset(wait)}.", wait)
        if requests is not None:
            requests.level -= 1
        if tokens is not None:
            tokens.level -= reserve
        self.in_flight += 1
        return Ticket(self, reserve), self.headers()

    def _refused(self, message: str, wait: float) -> QuotaExceeded:
        retry = [
            (b"retry-after", str(max(1, math.ceil(wait))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(wait * 1000))).encode()),
        ]
        return QuotaExceeded(message, headers=[*retry, *self.headers()])
