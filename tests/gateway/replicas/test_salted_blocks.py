"""Salted chains in both prefix indexes (pure, no engine): a prompt sent with vLLM's `cache_salt`
is rooted in its salt, so two tenants' equal prompts never share a block key, in the approximate
index (text blocks) or the precise one (token blocks from KV events, whose first block carries
the salt in `extra_keys`, and from /tokenize); each tenant still matches its own blocks.

The KV events are written as vLLM 0.32's publisher writes them (vllm/distributed/kv_events.py:
msgspec's tagged map of `BlockStored`, defaults omitted; `extra_keys` as
vllm/v1/core/kv_cache_utils.py `to_event_extra_keys` makes them: untagged, one entry per block,
the LoRA name then the salt on the first block). Importing vLLM for its structs would import
torch; the real engine's events are read in test_isolation_engine.py (tests/gateway/tenants)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest

from server.config import ServedModel
from server.gateway.replicas.approximate import ApproximateIndex
from server.gateway.replicas.blocks import (
    namespace,
    prompt_text,
    request_namespace,
    root,
    text_blocks,
    token_blocks,
)
from server.gateway.replicas.cache import CacheState
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.kv_events import Stored, apply, decode, first_block_salt
from server.gateway.replicas.pool import EnginePool
from server.gateway.replicas.precise import PreciseIndex
from server.gateway.settings import Routing

SALT_A, SALT_B = "a" * 64, "b" * 64
SYSTEM = "You are the travel desk. Plan trips with care, cite prices, never book without asking. " * 4
PROMPT = list(range(2000, 2032))  # eight blocks of 4 tokens


def chat(system: str, question: str, salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def engine_message(seq: int, *events: dict[str, Any]) -> list[bytes]:
    """One message as vLLM's ZmqEventPublisher sends it: [topic, seq, msgpack([ts, events, dp rank])]."""
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), 0])]


def vllm_stored(
    hashes: list[int], parent: int | None, tokens: list[int], *, salt: str | None = None, lora: str | None = None
) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 encodes it. Per block, the extra keys of its hash
    (generate_block_hash_extra_keys: `("lora", name, path)`, then `("cache_salt", salt)` on the
    first block only), published untagged (to_event_extra_keys: the name, the salt)."""
    extra: list[list[Any] | None] = []
    for index in range(len(hashes)):
        keys: list[Any] = []
        if lora is not None:
            keys.append(lora)
        if salt is not None and parent is None and index == 0:
            keys.append(salt)
        extra.append(keys or None)
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora,
    }
    if any(keys is not None for keys in extra):  # omit_defaults: None is not sent
        event["extra_keys"] = extra
    return event


# -- the chains ------------------------------------------------------------------------------------


def test_without_a_salt_the_chains_are_what_they_were():
    assert namespace("", "") == "" and namespace("sql-lora", "") == "sql-lora"
    assert request_namespace("", chat(SYSTEM, "hi")) == ""
    assert request_namespace("", {**chat(SYSTEM, "hi"), "cache_salt": None}) == ""  # not a string: no salt
    assert token_blocks(PROMPT, 4, namespace=namespace()) == token_blocks(PROMPT, 4)
    assert root(namespace()) == b"\x00" * 8


@pytest.mark.parametrize("adapter", ["", "sql-lora"])
def test_two_salts_share_no_block_and_one_salt_matches_itself(adapter: str) -> None:
    a, b = namespace(adapter, SALT_A), namespace(adapter, SALT_B)
    text = prompt_text(chat(SYSTEM, "Two days in Lisbon?")) or ""
    for blocks in (lambda ns: token_blocks(PROMPT, 4, namespace=ns), lambda ns: text_blocks(text, 64, namespace=ns)):
        keys_a, keys_b, unsalted = blocks(a), blocks(b), blocks(adapter)
        assert len(keys_a) == len(keys_b) == len(unsalted) > 3
        assert not set(keys_a) & set(keys_b) and not set(keys_a) & set(unsalted)  # not even the later blocks
        assert blocks(a) == keys_a
    assert namespace(adapter, SALT_A) != namespace("", SALT_A) or not adapter


def test_the_salt_enters_the_namespace_as_a_digest_only():
    assert SALT_A not in namespace("", SALT_A) and SALT_A not in namespace("sql-lora", SALT_A)
    assert request_namespace("", chat(SYSTEM, "hi", SALT_A)) == namespace("", SALT_A)


# -- the approximate index -------------------------------------------------------------------------


def test_approximate_index_tenants_with_one_system_prompt_match_only_their_own_blocks():
    index = ApproximateIndex()
    keys = {
        (tenant, question): text_blocks(prompt_text(chat(SYSTEM, question)) or "", 64, namespace=namespace("", salt))
        for tenant, salt in (("a", SALT_A), ("b", SALT_B))
        for question in ("first?", "second?")
    }
    index.record("e1", keys["a", "first?"], now=0.0)
    system_blocks = len(SYSTEM) // 64
    assert index.matched("e1", keys["a", "second?"], now=1.0) >= system_blocks  # A's repeat: its system prompt
    assert index.matched("e1", keys["b", "first?"], now=1.0) == 0  # B's equal prompt: nothing
    index.record("e2", keys["b", "first?"], now=2.0)
    assert index.matched("e2", keys["b", "second?"], now=3.0) >= system_blocks
    assert index.matched("e2", keys["a", "second?"], now=3.0) == 0


async def test_cache_state_reads_the_salt_from_the_body_the_engine_is_sent():
    cache = CacheState(block_chars=64)
    pool = EnginePool.from_models([ServedModel("tiny", ["http://a:1", "http://b:1"])], cache=cache).get("tiny")
    routing = Routing(policy="cache_aware", prefix_index="approximate")
    first = await pool.prompt(routing, chat(SYSTEM, "first?", SALT_A))
    assert first is not None and first.namespace == namespace("", SALT_A)
    decision = pool.route(routing, prompt=first)
    assert decision is not None
    again = await pool.prompt(routing, chat(SYSTEM, "second?", SALT_A))
    other = await pool.prompt(routing, chat(SYSTEM, "first?", SALT_B))
    assert again is not None and other is not None
    _, _, candidates = cache.candidates(pool.engines, again, now=time.monotonic(), precise=False)
    assert {c.engine.id: c.matched for c in candidates}[decision.engine.id] >= len(SYSTEM) // 64
    _, _, candidates = cache.candidates(pool.engines, other, now=time.monotonic(), precise=False)
    assert all(c.matched == 0 for c in candidates)


# -- the precise index, from vLLM's own events ------------------------------------------------------


@pytest.mark.parametrize("lora", [None, "sql-lora"])
def test_the_first_blocks_salt_is_read_from_vllms_extra_keys(lora: str | None) -> None:
    _, [event] = decode(engine_message(0, vllm_stored([1, 2], None, PROMPT[:8], salt=SALT_A, lora=lora)))
    assert isinstance(event, Stored)
    assert event.cache_salt == SALT_A and event.lora_name == lora
    _, [unsalted] = decode(engine_message(1, vllm_stored([3], None, PROMPT[:4], lora=lora)))
    assert isinstance(unsalted, Stored) and unsalted.cache_salt is None
    _, [continued] = decode(engine_message(2, vllm_stored([4], 2, PROMPT[8:12], salt=SALT_A, lora=lora)))
    assert isinstance(continued, Stored) and continued.cache_salt is None  # a continuation: its parent's chain


@pytest.mark.parametrize(
    ("extra_keys", "lora", "salt"),
    [
        (None, None, None),
        ([], None, None),
        ([None], None, None),
        ([["s"]], None, "s"),
        ([["sql-lora", "s"]], "sql-lora", "s"),
        ([["sql-lora"]], "sql-lora", None),
        ([[["mm-1", 0], "s", b"digest"]], None, "s"),  # multimodal pairs and prompt-embeds digests around it
        ("garbage", None, None),
        ([7], None, None),
    ],
)
def test_first_block_salt_of_any_extra_keys(extra_keys: Any, lora: str | None, salt: str | None) -> None:
    assert first_block_salt(extra_keys, lora) == salt


def precise_index_with(*messages: list[bytes]) -> PreciseIndex:
    index = PreciseIndex()
    for frames in messages:
        _, events = decode(frames)
        apply(index, "e1", events)
    return index


def test_precise_index_keys_salted_events_as_the_salted_prompt_and_never_as_another_tenants():
    index = precise_index_with(
        engine_message(0, vllm_stored([11, 12], None, PROMPT[:8], salt=SALT_A)),
        engine_message(1, vllm_stored([13, 14], 12, PROMPT[8:16], salt=SALT_A)),  # the same request, later
    )
    a = token_blocks(PROMPT, 4, namespace=request_namespace("", {"cache_salt": SALT_A}))
    b = token_blocks(PROMPT, 4, namespace=request_namespace("", {"cache_salt": SALT_B}))
    assert index.matched("e1", a, now=0.0) == 4
    assert index.matched("e1", b, now=0.0) == 0
    assert index.matched("e1", token_blocks(PROMPT, 4), now=0.0) == 0  # an unsalted prompt either
    index.removed("e1", [13, 14])
    assert index.matched("e1", a, now=0.0) == 2


def test_precise_index_two_tenants_equal_tokens_are_two_chains_on_one_engine():
    index = precise_index_with(
        engine_message(0, vllm_stored([21, 22], None, PROMPT[:8], salt=SALT_A)),
        engine_message(1, vllm_stored([31, 32], None, PROMPT[:8], salt=SALT_B)),
        engine_message(2, vllm_stored([41, 42], None, PROMPT[:8])),  # a shared tenant's: unsalted
    )
    assert index.held("e1") == 6  # six blocks, not two: the engine holds them apart too
    for salt in (SALT_A, SALT_B, ""):
        keys = token_blocks(PROMPT[:8], 4, namespace=namespace("", salt))
        assert index.matched("e1", keys, now=0.0) == 2
    index.removed("e1", [21, 22])
    assert index.matched("e1", token_blocks(PROMPT[:8], 4, namespace=namespace("", SALT_A)), now=0.0) == 0
    assert index.matched("e1", token_blocks(PROMPT[:8], 4, namespace=namespace("", SALT_B)), now=0.0) == 2


class FixedTokenizer:
    """/tokenize stand-in: the same token ids for every body (salting does not change tokens)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.bodies: list[Mapping[str, Any]] = []

    async def __call__(
        self, model: str, engines: Sequence[Engine], body: Mapping[str, Any], whole: bool = False
    ) -> list[int] | None:
        self.bodies.append(body)
        return self.tokens


async def test_precise_routing_sends_each_tenants_repeat_to_the_engine_holding_its_salted_blocks():
    tokenizer = FixedTokenizer(PROMPT)
    cache = CacheState(tokenize=tokenizer, block_chars=64)
    pool = EnginePool.from_models([ServedModel("tiny", ["http://a:1", "http://b:1"])], cache=cache).get("tiny")
    for engine in pool.engines:
        cache.precise.set_live(engine.id, True)
    routing = Routing(policy="cache_aware", prefix_index="precise")
    a_engine, b_engine = pool.engines
    # A's blocks on one engine, B's (the same tokens, B's salt) on the other, as their events say.
    apply(cache.precise, a_engine.id, decode(engine_message(0, vllm_stored([1, 2], None, PROMPT[:8], salt=SALT_A)))[1])
    apply(cache.precise, b_engine.id, decode(engine_message(0, vllm_stored([1, 2], None, PROMPT[:8], salt=SALT_B)))[1])
    for salt, holder in ((SALT_A, a_engine), (SALT_B, b_engine), (SALT_A, a_engine), (SALT_B, b_engine)):
        prompt = await pool.prompt(routing, chat(SYSTEM, "again?", salt))
        decision = pool.route(routing, prompt=prompt)
        assert decision is not None and decision.source == "precise"
        assert decision.engine is holder, decision
        matched = {c.engine.id: c.matched for c in decision.candidates}
        assert matched[holder.id] >= 2  # its stored blocks (and its routed prompts, speculatively)
        assert all(count == 0 for engine, count in matched.items() if engine != holder.id)
    assert all("cache_salt" in body for body in tokenizer.bodies)  # the prompt as the engine gets it
