"""The token counter: calibration, one tokenize call per new message, a bounded cache, verification.

The tokenizers here are small chat-template renderers written out in full, so the exact count of
any list is known; the claim under test is about how many calls the counter makes and how its
estimate relates to the exact count, not about vLLM (test_engine_e2e.py covers the real one).
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from server.gateway.trimming.core import trim_messages
from server.gateway.trimming.counter import TokenCounter
from server.gateway.trimming.keys import message_key
from tests.gateway.trimming.conversations import conversations


class Template:
    """A chat template: optional BOS per call, one block per message, a generation prompt.

    With `merge_consecutive`, consecutive messages of one role share a block (like templates that
    merge roles), so per-message counts do not add up.
    """

    def __init__(self, *, bos: int = 0, merge_consecutive: bool = False):
        self.bos = bos
        self.merge_consecutive = merge_consecutive
        self.calls: list[list[dict]] = []

    def exact(self, messages: list[dict], add_generation_prompt: bool) -> int:
        total = self.bos + (2 if add_generation_prompt else 0)
        previous = None
        for message in messages:
            if not (self.merge_consecutive and message["role"] == previous):
                total += 3  # block header and footer
            total += len(str(message.get("content") or "").split()) + 2 * len(message.get("tool_calls") or [])
            previous = message["role"]
        return total

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool, tools=None) -> int:
        self.calls.append(messages)
        # Tool definitions are rendered once, in front: 5 tokens each.
        return self.exact(messages, add_generation_prompt) + 5 * len(tools or [])


def _turn(i: int) -> dict:
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": f"message number {i} " + "word " * (i % 7)}


async def test_a_growing_conversation_costs_one_call_per_new_message():
    template = Template()
    counter = TokenCounter()
    history = [{"role": "system", "content": "be brief"}]
    calls_per_turn = []
    for i in range(12):
        history.append(_turn(i))
        before = len(template.calls)
        count = await counter.count("m", template.tokenize, history)
        calls_per_turn.append(len(template.calls) - before)
        assert count.total == template.exact(history, True)
    # First turn: calibration (7 probe calls) plus the two messages; then one call per turn.
    assert calls_per_turn[0] == 7 + 2
    assert calls_per_turn[1:] == [1] * 11
    assert all(len(call) == 1 for call in template.calls[9:])


async def test_identical_messages_are_counted_once_and_key_order_does_not_matter():
    template = Template()
    counter = TokenCounter()
    a = {"role": "user", "content": "same words"}
    b = {"content": "same words", "role": "user"}
    await counter.count("m", template.tokenize, [a])
    before = len(template.calls)
    count = await counter.count("m", template.tokenize, [a, b, dict(a)])
    assert len(template.calls) == before
    assert message_key(a) == message_key(b)
    assert count.per_message == [5, 5, 5]


async def test_models_have_separate_counts_and_calibrations():
    small, big = Template(), Template(bos=1)
    counter = TokenCounter()
    message = {"role": "user", "content": "hello there"}
    first = await counter.count("small", small.tokenize, [message])
    second = await counter.count("big", big.tokenize, [message])
    assert first.total == small.exact([message], True)
    assert second.total == big.exact([message], True)
    assert counter.calibration("big").per_call == 1
    assert counter.calibration("small").per_call == 0


async def test_the_cache_is_bounded_and_forgets_the_least_recently_used():
    template = Template()
    counter = TokenCounter(max_entries=3)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    await counter.count("m", template.tokenize, messages[:3])
    await counter.count("m", template.tokenize, [messages[0]])  # m0 is now the most recent
    await counter.count("m", template.tokenize, [messages[3]])  # evicts m1
    assert len(counter) == 3
    before = len(template.calls)
    await counter.count("m", template.tokenize, [messages[0], messages[2], messages[3]])
    assert len(template.calls) == before
    await counter.count("m", template.tokenize, [messages[1]])
    assert len(template.calls) == before + 1


async def test_many_new_messages_are_counted_in_bounded_batches():
    in_flight = 0
    peak = 0
    template = Template()

    async def tokenize(messages, add_generation_prompt):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1
        return template.exact(messages, add_generation_prompt)

    counter = TokenCounter(concurrency=4)
    history = [_turn(i) for i in range(40)]
    count = await counter.count("m", tokenize, history)
    assert count.total == template.exact(history, True)
    assert peak <= 7  # 4 per batch; calibration's 7 probes run once, on their own


@settings(max_examples=60, deadline=None)
@given(conversations(), st.integers(min_value=0, max_value=3), st.booleans())
async def test_estimates_are_exact_for_templates_with_a_per_call_constant(messages, bos, generation_prompt):
    template = Template(bos=bos)
    counter = TokenCounter()
    count = await counter.count("m", template.tokenize, messages, generation_prompt)
    assert count.total == template.exact(messages, generation_prompt)
    assert counter.calibration("m").trusted


async def test_an_over_estimate_keeps_the_model_trusted():
    template = Template(merge_consecutive=True)  # merged roles: fewer tokens than the sum
    counter = TokenCounter()
    messages = [{"role": "user", "content": "a b"}, {"role": "user", "content": "c d"}]
    count = await counter.count("m", template.tokenize, messages)
    exact = await counter.count_exact("m", template.tokenize, messages, True, estimate=count.total)
    assert exact == template.exact(messages, True) < count.total
    calibration = counter.calibration("m")
    assert calibration.trusted and calibration.max_short == 0  # an excess is no shortfall
    assert not counter.needs_verification("m", 900, 1000)


class ContextualTemplate(Template):
    """Renders every message after the first with an extra separator token: sums fall short."""

    def exact(self, messages: list[dict], add_generation_prompt: bool) -> int:
        return super().exact(messages, add_generation_prompt) + max(0, len(messages) - 1)


async def test_a_template_whose_sums_fall_short_is_not_trusted_and_always_verified():
    template = ContextualTemplate()
    counter = TokenCounter()
    messages = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    count = await counter.count("m", template.tokenize, messages)
    # The probe already shows it: three messages render longer than their parts.
    calibration = counter.calibration("m")
    assert not calibration.trusted and calibration.max_short > 0
    exact = await counter.count_exact("m", template.tokenize, messages, True, estimate=count.total)
    assert exact > count.total
    assert counter.needs_verification("m", 800, 1000)
    assert not counter.needs_verification("m", 10, 1000)


async def test_verification_is_asked_for_only_near_the_budget_when_counts_add_up():
    template = Template()
    counter = TokenCounter(verify_margin=8)
    await counter.count("m", template.tokenize, [{"role": "user", "content": "x"}])
    assert not counter.needs_verification("m", 100, 200)
    assert not counter.needs_verification("m", 192, 200)
    assert counter.needs_verification("m", 193, 200)
    assert counter.needs_verification("unknown model", 1, 200)


async def test_tool_definitions_are_counted_once_per_distinct_list():
    template = Template(bos=1)
    counter = TokenCounter()
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(3)]
    plain = await counter.count("m", template.tokenize, messages)
    with_tools = await counter.count("m", template.tokenize, messages, tools=tools)
    assert with_tools.total == plain.total + 15 == await template.tokenize(messages, True, tools=tools)
    before = len(template.calls)
    again = await counter.count("m", template.tokenize, [*messages, {"role": "assistant", "content": "x"}], tools=tools)
    assert len(template.calls) == before + 1  # only the new message
    assert again.total == template.exact([*messages, {"role": "assistant", "content": "x"}], True) + 15
    exact = await counter.count_exact("m", template.tokenize, messages, True, estimate=with_tools.total, tools=tools)
    assert exact == with_tools.total


@settings(max_examples=60, deadline=None)
@given(conversations(), st.integers(min_value=0, max_value=3))
async def test_a_cached_estimate_is_exact_for_seen_messages_and_an_upper_bound_for_new_ones(messages, bos):
    template = Template(bos=bos)
    counter = TokenCounter()
    assert counter.estimate_cached("m", messages) is None  # not calibrated yet
    seen, new = messages[: len(messages) // 2], messages[len(messages) // 2 :]
    await counter.count("m", template.tokenize, seen)
    calls = len(template.calls)
    quick = counter.estimate_cached("m", messages)
    assert len(template.calls) == calls  # no tokenize call
    assert quick.total >= template.exact(messages, True)
    new_keys = {message_key(m) for m in new} - {message_key(m) for m in seen}
    assert {message_key(m) for m in quick.unseen} == new_keys
    await counter.learn("m", template.tokenize, quick.unseen)
    assert len(template.calls) == calls + len(new_keys)
    again = counter.estimate_cached("m", messages)
    assert again.unseen == [] and again.total == template.exact(messages, True)


async def test_estimate_cached_needs_the_tools_cost_first():
    template = Template()
    counter = TokenCounter()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    await counter.count("m", template.tokenize, messages)
    assert counter.estimate_cached("m", messages, tools=tools) is None
    await counter.count("m", template.tokenize, messages, tools=tools)
    assert counter.estimate_cached("m", messages, tools=tools).total == template.exact(messages, True) + 5


# ---- the work per request is bounded (issue 15: 20,000 messages made 20,008 tokenize calls) ----


async def test_a_request_of_many_new_messages_tokenizes_at_most_max_calls_and_keeps_the_cache():
    template = Template()
    counter = TokenCounter(max_entries=1_000, max_calls=32)
    earlier = [_turn(i) for i in range(30)]
    await counter.count("m", template.tokenize, earlier)
    before = len(template.calls)
    flood = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20_000)]
    count = await counter.count("m", template.tokenize, flood, budget=100_000)
    assert len(template.calls) - before == 32
    assert [len(call) for call in template.calls[before:]] == [1] * 32
    # The newest 32 are exact, the rest upper bounds: never short of the truth.
    assert count.per_message[-32:] == [template.exact([m], False) for m in flood[-32:]]
    assert len(count.unseen) == 20_000 - 32
    assert count.total >= template.exact(flood, True)
    # The earlier conversation is still cached: no call to count it again.
    quick = counter.estimate_cached("m", earlier)
    assert quick is not None and quick.unseen == []
    assert len(counter) == 30 + 32


async def test_only_messages_that_could_still_fit_the_budget_are_counted():
    template = Template()
    counter = TokenCounter(max_calls=1_000)
    await counter.count("m", template.tokenize, [{"role": "user", "content": "calibrate"}])
    before = len(template.calls)
    # Each message costs 3 + 2 = 5 tokens, at least floor = 3 // 2 = 1; budget 40.
    messages = [{"role": "user", "content": f"x{i} y"} for i in range(500)]
    count = await counter.count("m", template.tokenize, messages, budget=40)
    calls = len(template.calls) - before
    assert 7 <= calls <= 40  # the newest messages up to where even a token each passes 40
    assert count.per_message[-7:] == [5] * 7  # the longest suffix that fits is exact
    # The rest cannot be sent whatever they cost: guessed from the counted ones' tokens per byte
    # (not the upper bound, which would inflate the dropped-token figures several times over).
    assert len(count.unseen) == 500 - calls
    assert all(3 <= value <= 7 for value in count.per_message)


async def test_the_instructions_and_the_newest_message_are_always_counted():
    template = Template()
    counter = TokenCounter(max_calls=4)
    await counter.count("m", template.tokenize, [{"role": "user", "content": "calibrate"}])
    system = {"role": "system", "content": "rules " * 50}
    newest = {"role": "user", "content": "question " * 80}
    middle = [{"role": "assistant", "content": f"a{i}"} for i in range(100)]
    count = await counter.count("m", template.tokenize, [system, *middle, newest], budget=20)
    assert count.per_message[0] == template.exact([system], False)
    assert count.per_message[-1] == template.exact([newest], False)
    assert system not in count.unseen and newest not in count.unseen


async def test_background_learning_is_bounded_too():
    template = Template()
    counter = TokenCounter(max_calls=8)
    await counter.count("m", template.tokenize, [{"role": "user", "content": "calibrate"}])
    before = len(template.calls)
    await counter.learn("m", template.tokenize, [{"role": "user", "content": f"n{i}"} for i in range(1_000)])
    assert len(template.calls) - before == 8


@settings(max_examples=80, deadline=None)
@given(conversations(), st.integers(min_value=1, max_value=6), st.integers(min_value=0, max_value=400), st.booleans())
async def test_with_few_calls_what_trimming_keeps_never_costs_more_than_counted(messages, max_calls, budget, bos):
    """Whatever was left uncounted, a prompt that fits by the counts fits for real: an uncounted
    message that could be sent is taken at its upper bound, and one guessed lower can never be
    part of a prompt that fits."""
    template = Template(bos=int(bos))
    counter = TokenCounter(max_calls=max_calls)
    count = await counter.count("m", template.tokenize, messages, budget=budget)
    assert len(template.calls) <= 7 + max_calls
    by_id = dict(zip(map(id, messages), count.per_message, strict=True))
    result = trim_messages(messages, budget, lambda m: by_id[id(m)], overhead=count.overhead)
    if result.fits:
        assert template.exact(result.messages, True) <= result.kept_tokens <= budget
