"""The quota counter stores (server.gateway.tenants.counters*): the host file shared by processes,
Redis (a real redis-server) and this process's memory give the same answers; a dead worker's slots
come back; Redis unreachable lets requests in unchecked (fail open) and says so."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.gateway.settings import GatewaySettings, TenantLimits
from server.gateway.tenants import counters_redis, resp
from server.gateway.tenants.counters import (
    CONCURRENT,
    OK,
    UNCHECKED,
    Limits,
    MemoryCounters,
    QuotaStoreUnavailable,
    check_quota_store,
)
from server.gateway.tenants.counters_host import HostCounters, HostFileError, create_host_file
from server.gateway.tenants.counters_redis import RedisCounters
from tests.gateway.tenants.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["a", "b"]


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def limits(**given: object) -> Limits:
    return Limits.of(TenantLimits.model_validate(given))


def script(seed: int, steps: int) -> list[tuple[str, int, float]]:
    """Random takes and releases: (op, tokens, seconds to advance the clock before it)."""
    rng = random.Random(seed)
    return [
        (rng.choice(["take", "take", "release"]), rng.choice([1, 5, 40, 120, 400]), rng.choice([0.0, 0.0, 0.7, 3.0]))
        for _ in range(steps)
    ]


# -- the host file ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_host_file_answers_as_memory_does_on_one_clock(tmp_path, seed):
    clock = Clock()
    memory = MemoryCounters(clock)
    host = HostCounters(create_host_file(str(tmp_path / "q"), 2, 2), NAMES, 0, clock)
    lim = limits(requests_per_minute=20, tokens_per_minute=1000, max_concurrent=3, window_seconds=60)
    held: list[int] = []
    try:
        for op, tokens, advance in script(seed, 400):
            clock.now += advance
            if op == "take":
                got = [store.take_now("b", lim, tokens) for store in (memory, host)]
                assert got[0].verdict == got[1].verdict
                assert got[0].wait == pytest.approx(got[1].wait)
                assert (got[0].requests, got[0].tokens) == pytest.approx((got[1].requests, got[1].tokens))
                if got[0].verdict == OK:
                    held.append(tokens)
            elif held:
                reserved = held.pop()
                for store in (memory, host):
                    store.release("b", lim, None, tokens - reserved)
            assert memory.peek("b", lim) == pytest.approx(host.peek("b", lim))
            assert memory.in_flight["b"] == host.in_flight("b") == len(held)
        assert host.in_flight("a") == 0  # the other tenant's counters are its own
    finally:
        host.close()


def test_two_workers_rows_count_one_set_of_slots(tmp_path):
    path = create_host_file(str(tmp_path / "q"), 2, 2)
    one, two = HostCounters(path, NAMES, 0), HostCounters(path, NAMES, 1)
    lim = limits(max_concurrent=2)
    try:
        assert one.take_now("a", lim, 1).verdict == OK
        assert two.take_now("a", lim, 1).verdict == OK
        assert one.take_now("a", lim, 1).verdict == CONCURRENT
        assert two.take_now("a", lim, 1).verdict == CONCURRENT
        assert two.take_now("b", lim, 1).verdict == OK  # tenant b has slots of its own
        one.release("a", lim, None, None)
        assert two.take_now("a", lim, 1).verdict == OK
        with pytest.raises(HostFileError, match="worker 1 is alive"):
            HostCounters(path, NAMES, 1)  # a row is one live worker's
        with pytest.raises(HostFileError, match="made for 2 tenants and 2 workers"):
            HostCounters(path, ["a"], 0)
    finally:
        one.close()
        two.close()


CHILD = """
import sys
from server.gateway.tenants.counters import Limits
from server.gateway.tenants.counters_host import HostCounters
path, row, takes, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "hold"
store = HostCounters(path, ["a", "b"], row)
lim = Limits(requests=300, tokens=0, concurrent=0 if not hold else 1, window=1e9)
print(sum(store.take_now("a", lim, 1).verdict == "ok" for _ in range(takes)), flush=True)
if hold:
    sys.stdin.read()  # until killed
"""


def child(path: str, row: int, takes: int, hold: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), path, str(row), str(takes), "hold" if hold else "go"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_processes_taking_at_once_get_exactly_the_limit(tmp_path):
    path = create_host_file(str(tmp_path / "q"), 2, 2)
    children = [child(path, row, 400) for row in (0, 1)]  # 800 takes at once for 300 requests
    admitted = [int(c.communicate(timeout=120)[0]) for c in children]
    assert sum(admitted) == 300, admitted


def test_a_dead_workers_slot_is_free_for_the_next_request_that_needs_it(tmp_path):
    path = create_host_file(str(tmp_path / "q"), 2, 2)
    holder = child(path, 1, 1, hold=True)  # takes tenant a's one slot, then waits
    store = HostCounters(path, NAMES, 0)
    lim = Limits(requests=300, tokens=0, concurrent=1, window=1e9)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        assert store.take_now("a", lim, 1).verdict == CONCURRENT  # its worker lives: the slot is its
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert store.in_flight("a") == 1  # still counted: nobody asked yet
        assert store.take_now("a", lim, 1).verdict == OK  # the first admission that needs it reclaims it
        assert store.in_flight("a") == 1  # this request's only
    finally:
        with holder:  # closes its pipes
            holder.kill()
        store.close()


# -- Redis ----------------------------------------------------------------------------------------


async def until(predicate, timeout: float = 60.0) -> None:
    """Poll `predicate` without blocking the loop (the stores' own tasks must run meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "not within the deadline"
        await asyncio.sleep(0.02)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path, password="s3cret-pw").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
@pytest.mark.parametrize("seed", [4, 5])
async def test_the_lua_script_answers_as_memory_does(redis_server, seed):
    # A window of 1e9 s: the refill between two steps (Redis's clock runs on) is below 1e-6 tokens.
    lim = limits(requests_per_minute=25, tokens_per_minute=2000, max_concurrent=3, window_seconds=1e9)
    memory, redis = MemoryCounters(Clock()), RedisCounters(redis_server.url)
    held: list[tuple[int, object]] = []
    try:
        for op, tokens, _ in script(seed, 300):
            if op == "take":
                mine, theirs = memory.take_now("t", lim, tokens), await redis.take("t", lim, tokens)
                assert mine.verdict == theirs.verdict
                assert (mine.requests, mine.tokens) == pytest.approx((theirs.requests, theirs.tokens), abs=1e-3)
                assert mine.wait == pytest.approx(theirs.wait, rel=1e-6)
                if mine.verdict == OK:
                    held.append((tokens, theirs.slot))
            elif held:
                reserved, slot = held.pop()
                memory.release("t", lim, None, tokens - reserved)
                redis.release("t", lim, slot, tokens - reserved)
                await asyncio.gather(*redis._pending)
            assert redis_server.call("ZCARD", "gateway:quota:{t}:slots") == len(held)
    finally:
        await redis.aclose()


@pytest.mark.redis
async def test_two_gateways_taking_at_once_get_exactly_the_limit(redis_server):
    lim = limits(requests_per_minute=40, window_seconds=1e9)
    stores = [RedisCounters(redis_server.url), RedisCounters(redis_server.url)]
    try:
        outcomes = await asyncio.gather(*(stores[i % 2].take("t", lim, 1) for i in range(120)))
        assert sum(o.verdict == OK for o in outcomes) == 40
        remaining = sorted(math.floor(o.requests) for o in outcomes if o.verdict == OK)
        assert remaining == list(range(40))  # each admitted request saw its own level
        ttl = redis_server.call("PTTL", "gateway:quota:{t}:buckets")
        assert isinstance(ttl, int) and ttl > 0  # the key goes when the bucket would be full again
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.redis
async def test_a_slot_is_leased_renewed_while_held_and_gone_a_lease_after_its_gateway(redis_server):
    lim = limits(max_concurrent=1)
    holder = RedisCounters(redis_server.url, lease=2.0, renew=0.2)
    other = RedisCounters(redis_server.url, lease=2.0, renew=0.2)
    try:
        taken = await holder.take("t", lim, 1)
        assert taken.verdict == OK
        key = "gateway:quota:{t}:slots"
        [member, first] = redis_server.call("ZRANGE", key, "0", "-1", "WITHSCORES")
        await until(lambda: float(redis_server.call("ZSCORE", key, member) or 0) > float(first))  # renewed
        assert (await other.take("t", lim, 1)).verdict == CONCURRENT
        holder._renewer.cancel()  # the gateway "dies": no release, no renewal
        seconds, micros = redis_server.call("TIME")
        now = int(seconds) + int(micros) / 1e6
        assert float(redis_server.call("ZSCORE", key, member)) <= now + 2.0  # gone within one lease
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (await other.take("t", lim, 1)).verdict != OK:
            assert loop.time() < deadline, "the dead gateway's slot never expired"
            await asyncio.sleep(0.1)
    finally:
        await holder.aclose()
        await other.aclose()


@pytest.mark.redis
async def test_redis_unreachable_lets_requests_in_unchecked_and_says_so_without_the_password(
    redis_server, caplog, monkeypatch
):
    monkeypatch.setattr(counters_redis, "RETRY_AFTER", 0.05)
    unchecked: list[str] = []
    store = RedisCounters(redis_server.url, unchecked=unchecked.append)
    lim = limits(requests_per_minute=1, window_seconds=1e9)
    try:
        assert (await store.take("t", lim, 1)).verdict == OK
        assert (await store.take("t", lim, 1)).verdict != OK  # over quota while Redis answers
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="gateway"):
            assert (await store.take("t", lim, 1)).verdict == UNCHECKED
            assert (await store.take("t", lim, 1)).verdict == UNCHECKED
        assert unchecked == ["t", "t"]
        warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1  # once per WARN_EVERY seconds, not once per request
        assert f"127.0.0.1:{redis_server.port}" in warnings[0] and "s3cret-pw" not in caplog.text
        redis_server.start()  # back, empty: the quota holds again
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while (outcome := await store.take("t", lim, 1)).verdict == UNCHECKED:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        assert outcome.verdict == OK and (await store.take("t", lim, 1)).verdict != OK
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_no_start_without_the_url_or_without_an_answer_and_never_the_password(redis_server):
    tenants = [{"name": "t", "api_keys": ["k"], "limits": {"requests_per_minute": 5}}]
    settings = GatewaySettings.model_validate({"tenants": tenants, "quota_store": {"backend": "redis"}})
    with pytest.raises(QuotaStoreUnavailable, match=r"\$GATEWAY_REDIS_URL .* is not set"):
        await check_quota_store(settings, {})
    await check_quota_store(settings, {"GATEWAY_REDIS_URL": redis_server.url})
    redis_server.stop()
    with pytest.raises(QuotaStoreUnavailable) as refused:
        await check_quota_store(settings, {"GATEWAY_REDIS_URL": redis_server.url})
    assert f"redis://127.0.0.1:{redis_server.port}/0" in str(refused.value)
    assert "s3cret-pw" not in str(refused.value)
    with pytest.raises(QuotaStoreUnavailable, match="not a redis://"):
        await check_quota_store(settings, {"GATEWAY_REDIS_URL": "http://x"})
    tenants[0]["limits"] = {}
    unlimited = GatewaySettings.model_validate({"tenants": tenants, "quota_store": {"backend": "redis"}})
    await check_quota_store(unlimited, {})  # nobody has limits: nothing to count, no server needed


async def test_a_server_that_never_answers_is_taken_as_down(monkeypatch):
    monkeypatch.setattr(counters_redis, "TIMEOUT", 0.3)
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        store = RedisCounters(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        try:
            assert (await store.take("t", limits(requests_per_minute=5), 1)).verdict == UNCHECKED
        finally:
            await store.aclose()


def test_the_resp_reader_waits_for_whole_answers_and_reads_every_kind():
    answer = b"*4\r\n$2\r\nok\r\n$1\r\n0\r\n:7\r\n*2\r\n+PONG\r\n$-1\r\n"
    for cut in range(len(answer)):
        with pytest.raises(resp._Incomplete):
            resp.parse(answer[:cut], 0)
    assert resp.parse(answer, 0) == (["ok", "0", 7, ["PONG", None]], len(answer))
    error, _ = resp.parse(b"-NOSCRIPT No matching script\r\n", 0)
    assert isinstance(error, resp.RespError) and str(error).startswith("NOSCRIPT")
    assert resp.encode(("EVALSHA", "ab", 2, 1.5)) == b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$3\r\n1.5\r\n"
