"""Reading a request's conversation for trimming: chat `messages`, and a Responses request's
`instructions` + `input` as the chat messages vLLM renders, with cuts mapped back to items."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.gateway.trimming.core import trim_messages
from server.gateway.trimming.history import chat_history, chat_tools, hides_history, responses_history
from server.gateway.trimming.watermark import watermark_trim
from tests.gateway.trimming.conversations import weight

# An input using every item kind vLLM 0.32 turns into chat messages.
ITEMS: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": [{"type": "input_text", "text": "hi there"}]},
    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}], "summary": []},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "one"},
    {"type": "function_call_output", "call_id": "c2", "output": "two"},
    {"role": "assistant", "content": "done"},
    {"role": "user", "content": "next"},
]


def test_responses_input_reads_as_the_chat_messages_vllm_builds():
    """The expected list is what vLLM 0.32's `construct_input_messages` returned for this request
    (ResponsesRequest(model, input=ITEMS, instructions="be brief"), run here), keys aside."""
    history = responses_history({"model": "m", "instructions": "be brief", "input": ITEMS})
    assert history is not None
    assert history.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}]},  # vLLM reads input_text as text
        {
            "role": "assistant",
            "reasoning": "think",
            "content": "calling",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ]
    assert history.generation_prompt and history.param == "input"
    assert history.answer_keys == ("max_output_tokens",)


def test_a_cut_keeps_the_instructions_the_leading_system_items_and_whole_tool_calls():
    body = {"model": "m", "instructions": "be brief", "input": ITEMS, "max_output_tokens": 5}
    history = responses_history(body)
    assert history is not None
    # Dropping the user message and the assistant turn with its calls (messages 2..5 of 8).
    trimmed, dropped = history.trimmed(4)
    assert trimmed["input"] == [ITEMS[0], ITEMS[8], ITEMS[9]]
    assert dropped == 7  # items, not chat messages
    assert trimmed["instructions"] == "be brief" and trimmed["max_output_tokens"] == 5
    assert body["input"] is ITEMS and len(ITEMS) == 10  # the client's body is not changed


def test_a_string_input_is_one_user_message():
    history = responses_history({"model": "m", "input": "hello"})
    assert history is not None and history.messages == [{"role": "user", "content": "hello"}]
    with_instructions = responses_history({"model": "m", "input": "hello", "instructions": "brief"})
    assert with_instructions is not None
    assert with_instructions.messages == [{"role": "system", "content": "brief"}, {"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "body",
    [
        {"input": None},
        {"input": []},
        {"input": 7},
        {"input": "x", "instructions": ["not", "a", "string"]},
        {"input": ["not an object"]},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
        {"input": [{"type": "reasoning", "encrypted_content": "opaque", "summary": []}]},
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},  # no call_id
        {"input": [{"role": "assistant", "content": []}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
        {"input": [{"role": "user", "content": {"text": "not a list"}}]},
    ],
)
def test_an_input_trimming_cannot_read_is_left_alone(body):
    assert responses_history(body) is None


def test_history_the_engine_keeps_is_seen_as_hidden():
    assert hides_history({"input": "more", "previous_response_id": "resp_1"})
    assert hides_history({"input": "more", "previous_input_messages": []})
    assert not hides_history({"input": "more"})


def test_an_unfinished_last_assistant_message_is_continued_without_a_generation_prompt():
    items = [{"role": "user", "content": "go"}, {"type": "message", "role": "assistant", "content": "par"}]
    assert responses_history({"input": items}).generation_prompt
    unfinished = [items[0], {**items[1], "status": "incomplete"}]
    assert not responses_history({"input": unfinished}).generation_prompt
    assert not chat_history({"messages": items, "continue_final_message": True}).generation_prompt


def test_responses_function_tools_are_counted_in_chat_form():
    tools = [
        {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}},
        {"type": "web_search_preview"},
    ]
    assert chat_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]
    assert chat_tools([{"type": "web_search_preview"}]) is None
    assert chat_tools("nonsense") is None


def test_chat_history_is_the_messages_list():
    messages = [{"role": "user", "content": "hi"}]
    history = chat_history({"messages": messages, "tools": [{"type": "function"}]})
    assert history is not None and history.messages is messages and history.tools == [{"type": "function"}]
    assert history.answer_keys == ("max_completion_tokens", "max_tokens") and history.param == "messages"
    assert chat_history({"messages": [{"content": "no role"}]}) is None
    assert chat_history({"messages": []}) is None


# ---- every cut trimming makes, mapped back to items, renders exactly the kept messages ----

_text = st.integers(min_value=0, max_value=30).map(lambda k: "w" * k)


@st.composite
def responses_inputs(draw: st.DrawFn) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [
        {"role": role, "content": text}
        for role, text in draw(st.lists(st.tuples(st.sampled_from(["system", "developer"]), _text), max_size=2))
    ]
    calls = 0
    for kind in draw(st.lists(st.sampled_from(["user", "user", "assistant", "tools", "reasoning"]), max_size=12)):
        if kind == "user":
            items.append(
                {"role": "user", "content": draw(st.sampled_from([draw(_text), [{"type": "input_text", "text": "q"}]]))}
            )
        elif kind == "assistant":
            items.append(
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": draw(_text)}]}
            )
        elif kind == "reasoning":
            items.append(
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": draw(_text)}], "summary": []}
            )
        else:
            ids = []
            for _ in range(draw(st.integers(min_value=1, max_value=3))):
                calls += 1
                ids.append(f"call_{calls}")
                items.append({"type": "function_call", "call_id": ids[-1], "name": "lookup", "arguments": draw(_text)})
            for call_id in ids:
                items.append({"type": "function_call_output", "call_id": call_id, "output": draw(_text)})
    items.append({"role": "user", "content": draw(_text)})
    return items


def _weight(message: dict[str, Any]) -> int:
    return weight({**message, "content": message.get("content") if isinstance(message.get("content"), str) else "q"})


@given(responses_inputs(), st.integers(min_value=0, max_value=400), st.booleans(), st.sampled_from([None, "", "rules"]))
def test_a_trimmed_responses_input_renders_as_exactly_the_kept_messages(items, budget, watermark, instructions):
    body: dict[str, Any] = {"model": "m", "input": items}
    if instructions is not None:
        body["instructions"] = instructions
    history = responses_history(body)
    assert history is not None
    if watermark:
        result = watermark_trim(history.messages, budget, budget * 2 // 3, _weight)
    else:
        result = trim_messages(history.messages, budget, _weight)
    if not result.trimmed:
        return
    trimmed, dropped = history.trimmed(result.dropped_messages)
    kept = trimmed["input"]
    again = responses_history(trimmed)
    assert again is not None and again.messages == result.messages
    assert dropped == len(items) - len(kept) > 0
    assert kept[-1] is items[-1]
    assert trimmed.get("instructions") == instructions
    # The leading system/developer items, then a suffix of the input.
    head = next(i for i, item in enumerate(items) if item.get("role") not in ("system", "developer"))
    assert kept[:head] == items[:head] and kept[head:] == items[len(items) - len(kept) + head :]
    # A function call's output is never kept without the call, nor the call without its output.
    kept_calls = {item["call_id"] for item in kept if item.get("type") == "function_call"}
    kept_outputs = {item["call_id"] for item in kept if item.get("type") == "function_call_output"}
    assert kept_calls == kept_outputs
