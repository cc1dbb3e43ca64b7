"""Quota counters in Redis, one set for every gateway replica (and every worker) using the server.

Per tenant two keys, in one hash slot (`{name}`), so a cluster keeps each script on one node:

    gateway:quota:{NAME}:buckets   hash rl, ra, tl, ta: the buckets' levels and times (seconds,
                                   the server's clock: gateways' clocks never meet); expires when
                                   both would be full again, which is what a missing key means
    gateway:quota:{NAME}:slots     sorted set: one member per request in flight, scored by when
                                   its lease ends; expires a lease after the last change

A decision is one Lua script (ADMIT: `decide` of tenants.counters, the same cases in the same
order), so it is atomic whatever the number of gateways. A request's slot is a lease of
SLOT_LEASE seconds that its gateway renews every SLOT_RENEW seconds while the request runs; a
gateway that dies (or loses its network) stops renewing, and its slots are gone SLOT_LEASE
seconds later at most. Release and settlement (SETTLE) are sent after the answer, off its path.

Redis unreachable (refused, reset, no answer within TIMEOUT seconds): fail open. The request goes
in unchecked (no quota, no rate-limit headers), counted in `gateway_quota_unchecked_total{tenant}`
and logged as a warning (once per WARN_EVERY seconds while it lasts); for RETRY_AFTER seconds the
gateway does not ask again, so an outage costs no timeout per request. A gateway that starts with
no server to reach is refused before it serves (`check_redis`). The URL's password is never
logged: errors name the host and port only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from server.gateway.settings import QuotaStore
from server.gateway.tenants.counters import OK, UNCHECKED, Limits, Outcome, QuotaStoreUnavailable
from server.gateway.tenants.resp import RespClient

log = logging.getLogger("gateway")

PREFIX = "gateway:quota:"
SLOT_LEASE = 10.0  # seconds a concurrency slot outlives its gateway's last renewal
SLOT_RENEW = 3.0  # seconds between two renewals of a gateway's slots
TIMEOUT = 2.0  # seconds for a connection or an answer; past it the store is taken as down
RETRY_AFTER = 1.0  # seconds without asking after a failure (fail open meanwhile)
WARN_EVERY = 10.0  # seconds between two warnings while Redis stays unreachable

ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rlim, tlim, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local clim, reserve, member, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local h = redis.call('HMGET', KEYS[1], 'rl', 'ra', 'tl', 'ta')
local function level(limit, lv, at)
  if limit == 0 then return 0 end
  if not lv then return limit end
  lv, at = tonumber(lv), tonumber(at)
  if now > at then lv = math.min(limit, lv + (now - at) * limit / window) end
  return lv
end
local rl, tl = level(rlim, h[1], h[2]), level(tlim, h[3], h[4])
local inflight = 0
if clim > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
end
local verdict, wait = 'ok', 0
if clim > 0 and inflight >= clim then
  verdict, wait = 'concurrent', 1
elseif tlim > 0 and reserve > tlim then
  verdict = 'too_large'
else
  if rlim > 0 and rl < 1 then verdict, wait = 'requests', (1 - rl) * window / rlim end
  if tlim > 0 and tl < reserve then
    local need = (reserve - tl) * window / tlim
    if need > wait then verdict, wait = 'tokens', need end
  end
  if verdict == 'ok' then
    if rlim > 0 then rl = rl - 1 end
    if tlim > 0 then tl = tl - reserve end
    if clim > 0 then
      redis.call('ZADD', KEYS[2], now + lease, member)
      redis.call('PEXPIRE', KEYS[2], math.ceil(lease * 2000))
    end
  end
end
if rlim > 0 or tlim > 0 then
  local full = 0
  if rlim > 0 then full = math.max(full, (rlim - rl) * window / rlim) end
  if tlim > 0 then full = math.max(full, (tlim - tl) * window / tlim) end
  local n = string.format('%.17g', now)
  redis.call('HSET', KEYS[1], 'rl', string.format('%.17g', rl), 'ra', n, 'tl', string.format('%.17g', tl), 'ta', n)
  redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
end
return {verdict, string.format('%.17g', wait), string.format('%.17g', rl), string.format('%.17g', tl)}
"""

SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tlim, window, delta, member = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
if member ~= '' then redis.call('ZREM', KEYS[2], member) end
if tlim > 0 and delta ~= '' then
  local h = redis.call('HMGET', KEYS[1], 'tl', 'ta')
  local tl = tlim
  if h[1] then
    tl = tonumber(h[1])
    local at = tonumber(h[2])
    if now > at then tl = math.min(tlim, tl + (now - at) * tlim / window) end
  end
  tl = math.min(tlim, tl - tonumber(delta))
  local n = string.format('%.17g', now)
  redis.call('HSET', KEYS[1], 'tl', string.format('%.17g', tl), 'ta', n)
  local full = (tlim - tl) * window / tlim
  local ttl = redis.call('PTTL', KEYS[1])
  redis.call('PEXPIRE', KEYS[1], math.max(ttl, math.ceil(full * 1000) + 1000))
end
return 1
"""

RENEW = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 2000))
return 1
"""


def where(url: str) -> str:
    """`redis://host:port/db` of a URL, without user or password (for logs and errors)."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme != "unix" else f"unix://{parts.path}"


def redis_url(config: QuotaStore, environ: Mapping[str, str]) -> str:
    """The server's URL from the variable the config names, or QuotaStoreUnavailable saying which."""
    url = environ.get(config.redis_url_env, "").strip()
    if not url:
        raise QuotaStoreUnavailable(
            f"quota_store.backend is redis but ${config.redis_url_env} (quota_store.redis_url_env) is not set: "
            "give it the server's URL, e.g. redis://redis:6379/0"
        )
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise QuotaStoreUnavailable(f"${config.redis_url_env} is not a redis://, rediss:// or unix:// URL")
    return url


async def check_redis(url: str) -> None:
    """PING the server of `url`, or QuotaStoreUnavailable with the reason."""
    client = RespClient(url, TIMEOUT)
    try:
        await client.call("PING")
    except Exception as exc:
        raise QuotaStoreUnavailable(f"cannot reach the Redis server at {where(url)}: {_reason(exc)}") from None
    finally:
        await client.aclose()


def _reason(exc: BaseException) -> str:
    """What went wrong (the client's and the OS's words name no password)."""
    return str(exc) or type(exc).__name__


class RedisCounters:
    """Every tenant's counters in one Redis server (see the module doc)."""

    def __init__(
        self,
        url: str,
        *,
        unchecked: Callable[[str], None] = lambda tenant: None,
        lease: float = SLOT_LEASE,
        renew: float = SLOT_RENEW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.where = where(url)
        self.client = RespClient(url, TIMEOUT)
        self.lease, self.renew_every, self.clock = lease, renew, clock
        self.unchecked = unchecked  # counts a request let in without asking (the metric)
        self.id = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
        self._serial = itertools.count()
        self._admit = self.client.script(ADMIT)
        self._settle = self.client.script(SETTLE)
        self._renew = self.client.script(RENEW)
        self.held: dict[str, set[str]] = {}  # tenant -> slots of this process's requests in flight
        self._pending: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._down_until = -math.inf
        self._warned_at = -math.inf

    @staticmethod
    def keys(name: str) -> list[str]:
        return [f"{PREFIX}{{{name}}}:buckets", f"{PREFIX}{{{name}}}:slots"]

    async def take(self, key: str, limits: Limits, reserve: int) -> Outcome:
        if self.clock() < self._down_until:
            self.unchecked(key)
            return Outcome(UNCHECKED)
        member = f"{self.id}:{next(self._serial)}" if limits.concurrent else ""
        args = (limits.requests, limits.tokens, limits.window, limits.concurrent, reserve, member, self.lease)
        try:
            verdict, wait, requests, tokens = await self._admit(keys=self.keys(key), args=args)
        except Exception as exc:  # redis errors, OSError, timeouts: the store is down for now
            self._failed(exc)
            self.unchecked(key)
            return Outcome(UNCHECKED)
        outcome = Outcome(verdict, float(wait), float(requests), float(tokens))
        if not limits.requests:
            outcome.requests = math.nan
        if not limits.tokens:
            outcome.tokens = math.nan
        if verdict == OK and member:
            outcome.slot = member
            self.held.setdefault(key, set()).add(member)
            if self._renewer is None:
                self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())
        return outcome

    def release(self, key: str, limits: Limits, slot: object, delta: int | None) -> None:
        member = slot if isinstance(slot, str) else ""
        if member:
            self.held.get(key, set()).discard(member)
        if not member and (delta is None or not limits.tokens):
            return
        args = (limits.tokens, limits.window, "" if delta is None else delta, member)
        task = asyncio.get_running_loop().create_task(self._send_settle(key, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_settle(self, key: str, args: tuple[object, ...]) -> None:
        try:
            await self._settle(keys=self.keys(key), args=args)
        except Exception as exc:  # its slot's lease runs out instead; the tokens stay as reserved
            self._failed(exc)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_every)
            for key, members in list(self.held.items()):
                if not members:
                    continue
                try:
                    await self._renew(keys=self.keys(key)[1:], args=(self.lease, *members))
                except Exception as exc:
                    self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        now = self.clock()
        self._down_until = now + RETRY_AFTER
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "quota store: the Redis server at %s is unreachable (%s): requests go in without quotas "
                "(fail open, gateway_quota_unchecked_total) until it answers again",
                self.where, _reason(exc),
            )  # fmt: skip

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._pending:
            await asyncio.wait(self._pending, timeout=TIMEOUT * 2)
        await self.client.aclose()
