"""The approximate record's size follows the engine's cache: its capacity in tokens, at the
characters per token learned from the engine's own prompt-token counter."""

from __future__ import annotations

import asyncio

from server.gateway.replicas.cache import CHARS_PER_TOKEN, LEARN_AFTER_TOKENS, CacheState
from server.gateway.replicas.engine import Engine, EngineMetrics

CAPACITY_TOKENS = 6144  # the routing profile's 48 blocks of 128 tokens


def engine_with(counted: float | None) -> Engine:
    engine = Engine("m", "http://a")
    engine.record_scrape(EngineMetrics(kv_capacity_tokens=CAPACITY_TOKENS, prefix_queries_tokens=counted), at=0.0)
    return engine


def send(cache: CacheState, engine: Engine, text: str) -> None:
    prompt = asyncio.run(cache.read("m", {"prompt": text}, [engine], precise=False))
    assert prompt is not None and prompt.chars == len(text)
    cache.sent(engine, prompt, now=0.0)


def test_the_record_starts_at_four_characters_a_token():
    cache = CacheState()
    engine = engine_with(None)
    send(cache, engine, "x" * 1000)
    assert cache.approximate.capacity(engine.id) == CAPACITY_TOKENS * CHARS_PER_TOKEN // cache.block_chars


def test_a_tokenizer_of_two_characters_a_token_halves_the_record():
    cache = CacheState()
    engine = engine_with(0)
    send(cache, engine, "start")  # the first reading of the counter
    for n in range(1, 5):  # 4 x 2,048 characters, which the engine counted as 4 x 1,024 tokens
        send(cache, engine, f"{n}" * 2048)
        engine.record_scrape(
            EngineMetrics(kv_capacity_tokens=CAPACITY_TOKENS, prefix_queries_tokens=1024.0 * n), at=float(n)
        )
    send(cache, engine, "next")  # sizing happens as a prompt is sent
    assert 1024 * 4 >= LEARN_AFTER_TOKENS
    assert cache.approximate.capacity(engine.id) == int(CAPACITY_TOKENS * 2.0 / cache.block_chars)


def test_the_ratio_stays_between_one_and_four_and_a_restart_starts_counting_again():
    cache = CacheState()
    engine = engine_with(0)
    send(cache, engine, "start")
    send(cache, engine, "y" * 100)
    # Other clients' prompts: 100 characters from here, 8,192 tokens counted by the engine.
    engine.record_scrape(EngineMetrics(kv_capacity_tokens=CAPACITY_TOKENS, prefix_queries_tokens=8192.0), at=1.0)
    send(cache, engine, "z")
    assert cache.approximate.capacity(engine.id) == int(CAPACITY_TOKENS * 1.0 / cache.block_chars)
    # The engine restarted: its counter went back; nothing is learned from the drop.
    engine.record_scrape(EngineMetrics(kv_capacity_tokens=CAPACITY_TOKENS, prefix_queries_tokens=10.0), at=2.0)
    send(cache, engine, "w" * 50_000)
    assert cache.approximate.capacity(engine.id) == int(CAPACITY_TOKENS * 1.0 / cache.block_chars)
