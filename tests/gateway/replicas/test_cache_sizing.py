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


class HalvingTokenizer:
    """/tokenize stand-in: one token per two characters of the prompt; counts its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.fail = fail

    async def __call__(self, model, engines, body, whole=False):  # type: ignore[no-untyped-def]
        self.calls.append((engines[0].id, whole))
        return None if self.fail else [0] * (len(body["prompt"]) // 2)


async def test_the_first_prompt_sizes_the_record_before_the_counter_can():
    """Issue 34's quiet runs: a phase ended before the engine's counter was read twice, so the
    record held twice what the tiny model's cache did for the whole of it."""
    tokenizer = HalvingTokenizer()
    cache = CacheState(tokenize=tokenizer)
    a, b = engine_with(None), Engine("m", "http://b")
    b.record_scrape(EngineMetrics(kv_capacity_tokens=CAPACITY_TOKENS), at=0.0)
    prompt = await cache.read("m", {"prompt": "y" * 1000}, [a, b], precise=False)
    await asyncio.gather(*cache._measuring.values())
    assert sorted(tokenizer.calls) == [("a", True), ("b", True)]  # each engine's own tokenizer, whole prompt
    assert prompt is not None
    cache.sent(a, prompt, now=0.0)
    assert cache.approximate.capacity(a.id) == CAPACITY_TOKENS * 2 // cache.block_chars
    await cache.read("m", {"prompt": "z" * 1000}, [a, b], precise=False)
    assert len(tokenizer.calls) == 2  # once per engine
    await cache.read("m", {"prompt": "z" * 1000}, [a, b], precise=True)
    assert len(tokenizer.calls) == 2  # precise routing tokenizes its own way (no events here: nothing)


async def test_a_failed_measurement_is_tried_again_and_the_guess_stays_meanwhile():
    tokenizer = HalvingTokenizer(fail=True)
    cache = CacheState(tokenize=tokenizer)
    a = engine_with(None)
    for _ in range(2):
        prompt = await cache.read("m", {"prompt": "y" * 1000}, [a], precise=False)
        await asyncio.gather(*cache._measuring.values())
    assert len(tokenizer.calls) == 2
    assert prompt is not None
    cache.sent(a, prompt, now=0.0)
    assert cache.approximate.capacity(a.id) == CAPACITY_TOKENS * CHARS_PER_TOKEN // cache.block_chars
    await cache.aclose()
