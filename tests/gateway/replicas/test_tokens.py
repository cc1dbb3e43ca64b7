"""The leading messages' token ids, remembered (tokens.py), and the tokenizer that uses them
(cache.EngineTokenizer) against a fake engine: no round trip for leading messages seen before,
none on the request path for new ones, and never for a template that renders them differently."""

from __future__ import annotations

import asyncio
import json

import httpx

from server.gateway.replicas.engine import Engine
from server.gateway.replicas.tokenizer import EngineTokenizer, tokenize_request
from server.gateway.replicas.tokens import CHECKS, LeadingTokens, leading_request, request_key

SYSTEM = {"role": "system", "content": "House rules. " * 20}


def chat(question: str, *history: dict[str, str]) -> dict[str, object]:
    return {"messages": [SYSTEM, *history, {"role": "user", "content": question}]}


def test_the_leading_request_is_every_message_but_the_last_without_the_generation_prompt():
    request = tokenize_request("m", {**chat("Hi?"), "tools": [{"type": "function"}]})
    assert request is not None
    head = leading_request(request)
    assert head == {"model": "m", "messages": [SYSTEM], "add_generation_prompt": False, "tools": [{"type": "function"}]}
    assert leading_request({"model": "m", "messages": [SYSTEM], "add_generation_prompt": True}) is None  # one message
    assert leading_request({"model": "m", "prompt": "text"}) is None
    assert leading_request({**request, "continue_final_message": True}) is None
    other = leading_request(tokenize_request("m", {**chat("Another?"), "tools": [{"type": "function"}]}) or {})
    assert other is not None and request_key(other) == request_key(head)  # the same leading part
    assert request_key(head) != request_key({**head, "tools": None})  # the tools render too


def test_leading_tokens_are_kept_only_when_the_whole_prompt_begins_with_them():
    memory = LeadingTokens(entries=2)
    assert memory.learn("m", b"k1", [1, 2, 3], [1, 2, 3, 4, 5])
    assert memory.get("m", b"k1") == [1, 2, 3] and memory.served == 1
    assert memory.get("m", b"nope") is None
    assert memory.learn("m", b"k2", [7], [7, 8]) and memory.learn("m", b"k3", [9], [9])
    assert memory.get("m", b"k1") is None and len(memory) == 2  # the least recently used went
    assert not memory.learn("m", b"k4", [1, 2, 9], [1, 2, 3, 4])  # rendered differently when more follow
    assert not memory.usable("m") and memory.get("m", b"k2") is None  # never served from memory again
    assert memory.usable("other") and not memory.learn("other", b"k5", [1, 2], [1])


class FakeEngine:
    """/tokenize: one token per character of the rendered messages (ChatML-like: prefix-stable), or,
    `stable=False`, a template that renders a lone leading message differently."""

    def __init__(self, *, stable: bool = True) -> None:
        self.stable = stable
        self.calls: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append(body)
        text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
        if body.get("add_generation_prompt"):
            text += "<assistant>"
        elif not self.stable:
            text = "!" + text
        return httpx.Response(200, json={"tokens": [ord(c) for c in text]})


async def test_new_leading_messages_are_learned_in_the_background_and_then_need_no_round_trip():
    fake = FakeEngine()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        engine = Engine("m", "http://a:1")
        assert await tokenizer("m", [engine], chat("First?")) is None  # new: route on at once
        await asyncio.gather(*tokenizer._learning.values())
        assert len(fake.calls) == 2 and len(tokenizer.leading) == 1  # the whole prompt and its leading part
        tokens = await tokenizer("m", [engine], chat("Second?"))
        assert len(fake.calls) == 2  # no round trip
        rendered = f"<system>{SYSTEM['content']}"
        assert tokens == [ord(c) for c in rendered]  # the leading messages' tokens, as the engine renders them
        single = await tokenizer("m", [engine], {"messages": [{"role": "user", "content": "Hi"}]})
        assert single == [ord(c) for c in "<user>Hi<assistant>"] and len(fake.calls) == 3  # nothing leads: whole


async def test_a_template_that_renders_leading_messages_differently_is_tokenized_whole_every_time():
    fake = FakeEngine(stable=False)
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        engine = Engine("m", "http://a:1")
        assert await tokenizer("m", [engine], chat("First?")) is None
        await asyncio.gather(*tokenizer._learning.values())
        assert not tokenizer.leading.usable("m")
        tokens = await tokenizer("m", [engine], chat("Second?"))
        assert tokens is not None and tokens[-len("<assistant>") :] == [ord(c) for c in "<assistant>"]
        assert len(fake.calls) == 3


async def test_a_failing_engine_leaves_nothing_learned_and_nothing_unread():
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(500))) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        assert await tokenizer("m", [Engine("m", "http://a:1")], chat("First?")) is None
        await asyncio.gather(*tokenizer._learning.values())
        assert len(tokenizer.leading) == 0 and not tokenizer._learning
    closed = EngineTokenizer(client, 1.0)  # its client is closed: the background task swallows the error
    assert await closed("m", [Engine("m", "http://a:1")], chat("Again?")) is None
    await asyncio.gather(*closed._learning.values())
    await closed.aclose()


async def test_the_background_goes_to_the_busiest_replica_and_a_whole_prompt_to_the_least_loaded():
    hosts: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return FakeEngine()(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        idle, busy = Engine("m", "http://idle:1"), Engine("m", "http://busy:1")
        assert await tokenizer("m", [idle, busy], chat("First?")) is None
        await asyncio.gather(*tokenizer._learning.values())
        assert hosts == ["busy", "busy"]  # the idle one is where this request goes next
        await tokenizer("m", [idle, busy], {"messages": [{"role": "user", "content": "Hi"}]})
        assert hosts[-1] == "idle"  # answered before routing: the quickest
        assert await tokenizer("m", [], chat("First?")) is None


async def test_a_conversations_next_turn_is_keyed_from_its_system_prompt_without_a_round_trip():
    fake = FakeEngine()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        engine = Engine("m", "http://a:1")
        assert await tokenizer("m", [engine], chat("First?")) is None
        await asyncio.gather(*tokenizer._learning.values())
        history = ({"role": "user", "content": "First?"}, {"role": "assistant", "content": "Noted."})
        tokens = await tokenizer("m", [engine], chat("Second?", *history))
        assert tokens == [ord(c) for c in f"<system>{SYSTEM['content']}"]  # the system prompt's, known
        await asyncio.gather(*tokenizer._learning.values())
        assert len(fake.calls) == 2 and len(tokenizer.leading) == 1  # no round trip, now or in the background
        other = await tokenizer("m", [engine], {"messages": [{"role": "system", "content": "Other."}, *history]})
        assert other is None and len(tokenizer._learning) == 1  # a new opening: learned
        await asyncio.gather(*tokenizer._learning.values())


def test_after_its_first_openings_check_out_a_model_is_learned_from_the_leading_part_alone():
    memory = LeadingTokens()
    assert not memory.learn("m", b"k0", [1, 2])  # unchecked: the whole prompt is needed
    for n in range(CHECKS):
        assert not memory.checked("m")
        assert memory.learn("m", bytes([n]), [n, 1], [n, 1, 2])
    assert memory.checked("m") and not memory.checked("other")
    assert memory.learn("m", b"later", [9, 9]) and memory.get("m", b"later") == [9, 9]
    assert not memory.learn("m", b"bad", [1], [2])  # a whole prompt given still checks
    assert not memory.usable("m")


async def test_a_checked_model_costs_one_round_trip_per_new_opening():
    fake = FakeEngine()
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
        tokenizer = EngineTokenizer(client, 1.0)
        engine = Engine("m", "http://a:1")
        for n in range(CHECKS + 2):
            opening = {"role": "system", "content": f"Desk {n}."}
            assert await tokenizer("m", [engine], {"messages": [opening, {"role": "user", "content": "Hi?"}]}) is None
            await asyncio.gather(*tokenizer._learning.values())
        assert len(fake.calls) == 2 * CHECKS + 2 and len(tokenizer.leading) == CHECKS + 2
        assert all(call["add_generation_prompt"] is False for call in fake.calls[-2:])  # the leading parts alone
