"""vLLM's KV events, received: decoding, sequence checks, and the subscriber against a real ZMQ
publisher in this process (the wire format of vllm/distributed/kv_events.py); the fallback to the
approximate index when an engine's endpoint is down. The real engine is in test_kv_events_engine.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec
import pytest
import zmq

from server.config import ServedModel
from server.gateway.replicas.blocks import token_blocks
from server.gateway.replicas.cache import CacheState
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.kv_events import (
    PURGE_REASONS,
    Cleared,
    EventError,
    KvEventsCollector,
    KvEventSubscriber,
    Removed,
    Sequencer,
    Stored,
    apply,
    decode,
)
from server.gateway.replicas.pool import EnginePool
from server.gateway.replicas.precise import PreciseIndex
from server.gateway.settings import Routing
from tests.support import async_wait_for, refusing_port

PROMPT = list(range(1000, 1016))  # four blocks of 4 tokens


def stored_event(hashes: list[Any], parent: Any, tokens: list[int], size: int = 4) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def message(seq: int, *events: object) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), 0])]


# -- decoding ------------------------------------------------------------------------------------


def test_decode_reads_vllms_tagged_maps():
    seq, events = decode(
        message(
            7,
            stored_event([b"h1"], None, PROMPT[:4]),
            {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew"},
        )
    )
    assert seq == 7
    assert events == [Stored([b"h1"], None, PROMPT[:4], 4), Removed([b"h1"]), Cleared()]


def test_decode_reads_the_array_form_of_older_vllm():
    _, events = decode(
        message(
            0,
            ["BlockStored", [5, 6], 4, PROMPT[:8], 4, None, "GPU", "sql-lora"],
            ["BlockRemoved", [5], "GPU"],
            ["AllBlocksCleared"],
        )
    )
    assert events == [Stored([5, 6], 4, PROMPT[:8], 4, "sql-lora"), Removed([5]), Cleared()]


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", b"\x00" * 8],
        [b"kv", b"\x00", b"\x90"],
        [b"kv", b"\x00" * 8, b"\xc1"],
        [b"kv", b"\x00" * 8, msgspec.msgpack.encode({"events": []})],
    ],
)
def test_decode_refuses_what_is_not_an_event_batch(frames: list[bytes]) -> None:
    with pytest.raises(EventError):
        decode(frames)


def test_the_sequencer_tells_gaps_and_restarts():
    sequencer = Sequencer()
    assert [sequencer.check(s) for s in (5, 6, 7)] == [None, None, None]
    assert sequencer.check(9) == "gap"
    assert sequencer.check(0) == "restart"
    assert sequencer.check(1) is None


def test_apply_writes_events_in_order():
    index = PreciseIndex()
    apply(index, "a", [Stored([1, 2], None, PROMPT[:8], 4), Stored([3], 2, PROMPT[8:12], 4), Removed([3])])
    assert index.matched("a", token_blocks(PROMPT, 4), now=0) == 2
    apply(index, "a", [Cleared()])
    assert index.held("a") == 0 and index.state("a").purges == {"cleared": 1}


# -- the subscriber, against a real publisher ----------------------------------------------------


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[zmq.Socket[bytes], str]]:
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield socket, f"tcp://127.0.0.1:{port}"
    finally:
        socket.close(linger=0)
        context.term()


async def test_events_arrive_blocks_are_attributed_and_every_discontinuity_purges(publisher):
    socket, endpoint = publisher
    index = PreciseIndex()
    subscriber = KvEventSubscriber(index, {"a:1": endpoint})
    await subscriber.start()
    try:
        await async_wait_for(lambda: index.is_live("a:1"), what="the subscriber connects")
        keys = token_blocks(PROMPT, 4)
        seq = 0

        def publish(*events: object) -> None:
            nonlocal seq
            socket.send_multipart(message(seq, *events))
            seq += 1

        def stored_until_seen() -> bool:  # a SUB socket misses what is sent before it has subscribed
            publish(stored_event([b"h1", b"h2"], None, PROMPT[:8]))
            return index.matched("a:1", keys, now=0) == 2

        await async_wait_for(stored_until_seen, what="the first BlockStored arrives")
        publish(stored_event([b"h3", b"h4"], b"h2", PROMPT[8:]))
        await async_wait_for(lambda: index.matched("a:1", keys, now=0) == 4)

        seq += 3  # three messages lost
        publish(stored_event([b"x"], None, [1, 2, 3, 4]))
        await async_wait_for(lambda: index.state("a:1").purges.get("gap") == 1)
        assert index.matched("a:1", keys, now=0) == 0 and index.held("a:1") == 1 and index.is_live("a:1")

        seq = 0  # the engine restarted between two messages
        publish(stored_event([b"h1", b"h2"], None, PROMPT[:8]))
        await async_wait_for(lambda: index.state("a:1").purges.get("restart") == 1)
        assert index.matched("a:1", keys, now=0) == 2

        publish({"type": "AllBlocksCleared"})
        await async_wait_for(lambda: index.state("a:1").purges.get("cleared") == 1)
        assert index.held("a:1") == 0 and index.is_live("a:1")

        socket.close(linger=0)  # the engine goes away: not live, so routing falls back
        await async_wait_for(lambda: not index.is_live("a:1"), what="the disconnect is seen")
        assert index.state("a:1").purges.get("disconnect") == 1
    finally:
        await subscriber.aclose()
    assert not index.is_live("a:1")


def test_the_collector_shows_live_blocks_and_purges():
    index = PreciseIndex()
    apply(index, "a:1", [Stored([1], None, PROMPT[:4], 4)])
    index.set_live("a:1", True)
    index.purge("b:1", "disconnect")
    families = {f.name: f for f in KvEventsCollector(index, {"a:1": "m", "b:1": "m"}).collect()}
    up = {s.labels["engine"]: s.value for s in families["gateway_engine_kv_events_up"].samples}
    assert up == {"a:1": 1.0, "b:1": 0.0}
    blocks = {s.labels["engine"]: s.value for s in families["gateway_engine_kv_events_blocks"].samples}
    assert blocks == {"a:1": 1.0, "b:1": 0.0}
    purges = [
        (s.labels["engine"], s.labels["reason"], s.value)
        for s in families["gateway_engine_kv_events_purges"].samples
        if s.name.endswith("_total")
    ]
    assert [p for p in purges if p[2]] == [("b:1", "disconnect", 1.0)]
    # Every engine has every reason's series from 0, so a rate over it has data before the first purge.
    assert {(engine, reason) for engine, reason, _ in purges} == {
        (engine, reason) for engine in ("a:1", "b:1") for reason in PURGE_REASONS
    }


# -- the fallback --------------------------------------------------------------------------------


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(
        self, model: str, engines: Sequence[Engine], body: Mapping[str, Any], whole: bool = False
    ) -> list[int] | None:
        self.calls += 1
        return list(PROMPT)


async def test_while_an_engines_endpoint_is_down_routing_is_approximate():
    tokenizer = CountingTokenizer()
    cache = CacheState(tokenize=tokenizer, block_chars=16)
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1", "http://b:1"])], cache=cache).get("m")
    routing = Routing(policy="cache_aware", prefix_index="precise")
    body = {"messages": [{"role": "user", "content": "the same long question, " * 8}]}
    with refusing_port() as port_a, refusing_port() as port_b:  # nothing will ever publish there
        subscriber = KvEventSubscriber(
            cache.precise, {"a:1": f"tcp://127.0.0.1:{port_a}", "b:1": f"tcp://127.0.0.1:{port_b}"}
        )
        await subscriber.start()
        try:
            decisions = []
            for _ in range(3):
                prompt = await pool.prompt(routing, body)
                decision = pool.route(routing, prompt=prompt)
                assert decision is not None
                decisions.append(decision)
        finally:
            await subscriber.aclose()
    assert [d.source for d in decisions] == ["approximate"] * 3
    assert tokenizer.calls == 0  # no round trip for a precise match that cannot be used
    assert decisions[1].engine is decisions[0].engine is decisions[2].engine  # the record keeps them together
    assert decisions[1].reason == "prefix"
    assert decisions[1].explain()["matched"][decisions[0].engine.id] == decisions[1].prompt_blocks > 0


async def test_once_every_engines_events_are_live_routing_is_precise():
    tokenizer = CountingTokenizer()
    cache = CacheState(tokenize=tokenizer)
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1", "http://b:1"])], cache=cache).get("m")
    routing = Routing(policy="cache_aware", prefix_index="precise")
    for engine in ("a:1", "b:1"):
        cache.precise.set_live(engine, True)
    apply(cache.precise, "b:1", [Stored([1, 2, 3], None, PROMPT[:12], 4)])
    prompt = await pool.prompt(routing, {"messages": [{"role": "user", "content": "anything"}]})
    decision = pool.route(routing, prompt=prompt)
    assert tokenizer.calls == 1
    assert decision is not None and decision.source == "precise" and decision.engine.id == "b:1"
    assert decision.prompt_blocks == 4 and decision.explain()["matched"] == {"a:1": 0, "b:1": 3}
    # All the request's blocks count as held on b for a moment (speculative), until its events arrive.
    now = time.monotonic()
    assert cache.precise.matched("b:1", token_blocks(PROMPT, 4), now=now) == 4
    assert cache.precise.matched("b:1", token_blocks(PROMPT, 4), now=now + 60) == 3
    assert cache.precise.matched("a:1", token_blocks(PROMPT, 4), now=now) == 0
