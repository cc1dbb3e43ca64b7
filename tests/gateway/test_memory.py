"""No memory growth across 10,000 requests: nothing per request outlives its request."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from server.gateway.proxy.exchange import Exchange
from tests.gateway.conftest import fast_settings
from tests.support import wait_for

REQUESTS = 10_000
WARMUP = 1_000
CONCURRENCY = 32
ROOT = Path(__file__).resolve().parents[2]


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _drive(url: str, count: int) -> int:
    """Failures among `count` requests sent by tests.gateway.drive in its own process."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.gateway.drive", url, str(count), str(CONCURRENCY)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return int(done.stdout.strip())


@pytest.mark.one_process("measures the memory of the test process, where the gateway runs")
def test_no_memory_growth_across_10000_requests(engines, gateway):
    (engine,) = engines(1, ttft_ms=0, itl_ms=0, tokens=3)
    gw = gateway(fast_settings({"standin": [engine.url]}, health={"interval": 60}))
    assert (_drive(gw.url, WARMUP)) == 0
    objects_before, rss_before = _live_objects(), _rss_bytes()

    gc.disable()  # so that every reference cycle a request leaves behind is still there to count
    try:
        assert (_drive(gw.url, REQUESTS - WARMUP)) == 0
        cyclic_garbage = gc.collect()
    finally:
        gc.enable()
    objects_after, rss_after = _live_objects(), _rss_bytes()
    # Cycles need the collector's full passes, which stall every stream; requests make none.
    assert cyclic_garbage < 1000, cyclic_garbage
    # A leak of one small object per request would add 9,000 objects; allow for caches settling.
    # (The driver is another process: these counts are the gateway's and the stand-in's.)
    assert objects_after - objects_before < 1500, objects_after - objects_before
    assert rss_after - rss_before < 16 * 2**20, (rss_after - rss_before) / 2**20
    # The last requests' bookkeeping runs on the gateway's thread just after their responses: poll.
    wait_for(lambda: not [o for o in gc.get_objects() if type(o) is Exchange], interval=0.2)  # type(), not __class__
    pool = gw.state.upstreams.models["standin"]
    wait_for(lambda: all(e.outstanding == 0 for e in pool.engines))
    transport = gw.state.proxy.context.upstream
    assert transport.idle_connections() <= CONCURRENCY
    assert engine.stats()["running"] == 0
