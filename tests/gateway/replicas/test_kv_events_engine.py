"""The KV-event subscriber against a real vLLM engine (tiny-cpu-routing: KV events on): events
arrive, a prompt's blocks are attributed to the engine that cached them, and an engine that
restarts is purged (its new cache is empty) and attributed again once it caches the prompt anew."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.engine.render import local_kv_events_port
from server.gateway.replicas.blocks import token_blocks
from server.gateway.replicas.kv_events import KvEventSubscriber
from server.gateway.replicas.precise import PreciseIndex
from tests.engine_process import START_TIMEOUT, stop
from tests.support import async_wait_for, free_port, wait_for

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "configs" / "profiles" / "tiny-cpu-routing.yaml"
BODY = {
    "model": "tiny",
    "max_tokens": 4,
    "messages": [
        {"role": "system", "content": "You are the travel desk of tenant forty-two. " + "Plan trips with care. " * 60},
        {"role": "user", "content": "Two days in Lisbon?"},
    ],
}


def start_engine(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "engine", str(PROFILE), "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the engine exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, timeout=START_TIMEOUT, interval=0.5, what="the engine answers /health")
    return process


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    port = free_port()
    log = tmp_path_factory.mktemp("kv-events") / "engine.log"
    state: dict[str, object] = {
        "port": port,
        "log": log,
        "process": start_engine(port, log),
        "url": f"http://127.0.0.1:{port}",
        "events": f"tcp://127.0.0.1:{local_kv_events_port(port)}",
    }
    try:
        yield state
    finally:
        process = state["process"]
        assert isinstance(process, subprocess.Popen)
        stop(process)


async def test_events_arrive_blocks_are_attributed_and_a_restarted_engine_is_purged(engine):
    url, endpoint = str(engine["url"]), str(engine["events"])
    index = PreciseIndex()
    subscriber = KvEventSubscriber(index, {"e": endpoint})
    await subscriber.start()
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            await async_wait_for(lambda: index.is_live("e"), timeout=60, what="subscribed to the engine's events")
            tokens = await client.post(f"{url}/tokenize", json={"model": "tiny", "messages": BODY["messages"]})
            keys = token_blocks(tokens.json()["tokens"], 128)
            assert len(keys) >= 3

            async def cached() -> bool:  # a SUB socket can miss what is published before it subscribed
                (await client.post(f"{url}/v1/chat/completions", json=BODY)).raise_for_status()
                return index.matched("e", keys, now=time.monotonic()) == len(keys)

            await async_wait_for(cached, timeout=120, interval=0.5, what="the prompt's blocks are attributed")
            assert index.block_size("e") == 128 and index.state("e").stored >= len(keys)

            process = engine["process"]
            assert isinstance(process, subprocess.Popen)
            stop(process)  # the engine goes away: purged, not live, routing falls back to approximate
            await async_wait_for(lambda: not index.is_live("e"), timeout=60, what="the disconnect is seen")
            assert index.held("e") == 0 and index.state("e").purges.get("disconnect", 0) >= 1

            engine["process"] = start_engine(int(str(engine["port"])), Path(str(engine["log"])))
            await async_wait_for(lambda: index.is_live("e"), timeout=60, what="reconnected to the new engine")
            assert index.matched("e", keys, now=time.monotonic()) == 0  # its new cache is empty
            await async_wait_for(cached, timeout=120, interval=0.5, what="attributed again after the restart")
    finally:
        await subscriber.aclose()
