"""The pure trimming function: its invariants over random conversations, and readable examples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from server.gateway.trimming.core import leading_instructions, trim_messages
from tests.gateway.trimming.conversations import conversations, weight


def _pairs_intact(kept: list[dict], original: list[dict]) -> bool:
    """Every kept tool result has its call kept, and every kept call has all its results kept."""
    kept_ids = {id(m) for m in kept}
    for message in original:
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        call_ids = {c["id"] for c in message["tool_calls"]}
        results = [m for m in original if m.get("role") == "tool" and m.get("tool_call_id") in call_ids]
        group = [message, *results]
        states = {id(m) in kept_ids for m in group}
        if len(states) > 1:
            return False
    return True


def _expected_cut(messages: list[dict], budget: int, overhead: int) -> int | None:
    """Brute force: the start index of the kept suffix, or None if nothing fits."""
    head = leading_instructions(messages)
    n = len(messages)
    counts = [weight(m) for m in messages]
    if sum(counts) + overhead <= budget:
        return head
    candidates = []
    for cut in range(head + 1, n):
        kept = messages[:head] + messages[cut:]
        if messages[cut]["role"] == "tool" or not _pairs_intact(kept, messages):
            continue
        if sum(counts[:head]) + sum(counts[cut:]) + overhead <= budget:
            candidates.append(cut)
    on_user = [c for c in candidates if messages[c]["role"] == "user"]
    chosen = on_user or candidates
    return chosen[0] if chosen else None


@settings(max_examples=400, deadline=None)
@given(conversations(), st.integers(min_value=0, max_value=600), st.integers(min_value=0, max_value=12))
def test_invariants_hold_for_random_conversations(messages, budget, overhead):
    result = trim_messages(messages, budget, weight, overhead=overhead)
    head = leading_instructions(messages)
    total = sum(map(weight, messages)) + overhead

    expected = _expected_cut(messages, budget, overhead)
    if expected is None:
        # Even the minimum does not fit: nothing mangled, both numbers reported.
        assert not result.fits
        assert result.messages == messages
        assert result.required_tokens > budget
        assert result.budget == budget
        assert result.dropped_messages == 0
        return

    assert result.fits
    kept = result.messages
    # The budget holds, and the accounting adds up.
    assert sum(map(weight, kept)) + overhead == result.kept_tokens <= budget
    assert result.kept_tokens + result.dropped_tokens == total
    assert len(kept) + result.dropped_messages == len(messages)
    # Instructions first, then a suffix of the conversation ending with the newest message.
    assert kept[:head] == messages[:head]
    assert kept[-1] is messages[-1]
    rest = kept[head:]
    assert rest == messages[len(messages) - len(rest) :]
    assert kept == messages[:head] + messages[len(messages) - len(rest) :]
    # Tool calls and their results stay together; no orphan tool message starts the history.
    assert _pairs_intact(kept, messages)
    if result.trimmed:
        assert rest[0]["role"] != "tool"
    # The longest suffix, starting on a user message where such a cut fits.
    assert len(messages) - len(rest) == expected


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(min_value=0, max_value=12))
def test_required_tokens_is_the_smallest_budget_that_fits(messages, overhead):
    """When trimming refuses, the number it reports is exactly the budget that would have worked."""
    refused = trim_messages(messages, 0, weight, overhead=overhead)
    if refused.fits:  # only possible when everything weighs nothing
        return
    needed = refused.required_tokens
    assert trim_messages(messages, needed, weight, overhead=overhead).fits
    assert not trim_messages(messages, needed - 1, weight, overhead=overhead).fits


# -- examples ---------------------------------------------------------------------------------


def _count_words(message: dict) -> int:
    return len((message.get("content") or "").split()) + 1


def test_the_seeds_shape_keeps_system_and_context_and_drops_oldest_turns():
    system = {"role": "system", "content": "rule " * 50}
    context = {"role": "user", "content": "doc " * 200}
    turns = []
    for i in range(20):
        turns.append({"role": "user", "content": f"question {i} " + "q " * 10})
        turns.append({"role": "assistant", "content": f"answer {i} " + "a " * 20})
    newest = {"role": "user", "content": "and now?"}
    messages = [system, context, *turns, newest]

    result = trim_messages(messages, 400, _count_words, overhead=5)

    assert result.fits and result.trimmed
    assert result.messages[0] is system
    assert result.messages[-1] is newest
    assert context not in result.messages  # the oldest turn goes first
    assert result.messages[1]["role"] == "user"
    assert result.kept_tokens <= 400
    assert result.dropped_tokens == sum(map(_count_words, messages)) + 5 - result.kept_tokens


def test_nothing_is_dropped_when_everything_fits():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    result = trim_messages(messages, 100, _count_words)
    assert result.messages == messages
    assert not result.trimmed
    assert result.kept_tokens == 5


def test_tool_call_and_its_results_go_together():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny " * 30},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    # The newest message is a tool result: its call and its sibling result must stay too,
    # and the user turn before it fits only in the larger budget.
    tight = trim_messages(messages, 41, _count_words)
    assert [m["role"] for m in tight.messages] == ["system", "assistant", "tool", "tool"]
    roomy = trim_messages(messages, 42, _count_words)
    assert roomy.messages == messages
    refused = trim_messages(messages, 35, _count_words)
    assert not refused.fits
    assert refused.required_tokens == 2 + 1 + 31 + 2


def test_the_kept_history_starts_on_a_user_message_when_one_fits():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1 " * 10},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "assistant", "content": "a3"},
    ]
    # Budget for [system, a2, a3] + [u2]: the longest suffix starts on u2.
    result = trim_messages(messages, 8, _count_words)
    assert [m.get("content") for m in result.messages] == ["s", "u2", "a2", "a3"]
    # With room for only [system, a2?, a3]: no user cut fits; the longest one that does is taken.
    result = trim_messages(messages, 6, _count_words)
    assert [m.get("content") for m in result.messages] == ["s", "a2", "a3"]


def test_refuses_when_system_plus_newest_does_not_fit():
    messages = [
        {"role": "system", "content": "x " * 50},
        {"role": "user", "content": "old"},
        {"role": "user", "content": "y " * 50},
    ]
    result = trim_messages(messages, 80, _count_words, overhead=3)
    assert not result.fits
    assert result.required_tokens == 51 + 51 + 3
    assert result.budget == 80
    assert result.messages == messages


def test_a_tool_result_keeps_its_call_even_when_other_messages_sit_between():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "old " * 20},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "user", "content": "still there?"},
        {"role": "tool", "tool_call_id": "a", "content": "done"},
    ]
    # Cutting at "still there?" would fit 7 tokens but orphan the result; the call must stay.
    assert not trim_messages(messages, 7, _count_words).fits
    result = trim_messages(messages, 8, _count_words)
    assert [m["role"] for m in result.messages] == ["system", "assistant", "user", "tool"]
