"""Hypothesis strategies for OpenAI chat conversations with tool calls, shared by the trimming tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Message = dict[str, Any]


def weight(message: Message) -> int:
    """A stand-in token count: content length plus a per-message and per-call cost."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    return 3 + len(content) + sum(4 + len(c["function"]["arguments"]) for c in calls)


_text = st.integers(min_value=0, max_value=40).map(lambda k: "w" * k)


@st.composite
def units(draw: st.DrawFn, next_id: list[int]) -> list[Message]:
    """One conversational unit: a user turn, an assistant reply, or a tool call with its results."""
    kind = draw(st.sampled_from(["user", "user", "assistant", "tools", "tools", "developer", "orphan"]))
    if kind in {"user", "assistant", "developer"}:
        return [{"role": kind, "content": draw(_text)}]
    if kind == "orphan":  # a tool result whose call the client already dropped
        return [{"role": "tool", "tool_call_id": "ghost", "content": draw(_text)}]
    calls = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        next_id[0] += 1
        calls.append(
            {
                "id": f"call_{next_id[0]}",
                "type": "function",
                "function": {"name": "lookup", "arguments": draw(_text)},
            }
        )
    assistant = {"role": "assistant", "content": draw(st.sampled_from([None, "", "thinking"])), "tool_calls": calls}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": draw(_text)} for c in calls]
    return [assistant, *results]


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    head = draw(
        st.lists(
            st.builds(
                lambda role, text: {"role": role, "content": text}, st.sampled_from(["system", "developer"]), _text
            ),
            max_size=2,
        )
    )
    next_id = [0]
    body: list[Message] = []
    for unit in draw(st.lists(units(next_id), min_size=0, max_size=12)):
        body.extend(unit)
    if not head and not body:
        body = [{"role": "user", "content": draw(_text)}]
    return head + body
