"""Responses inputs for the trimming tests: long conversations with tool calls and their outputs."""

from __future__ import annotations

from typing import Any


def responses_conversation(turns: int, words: int = 20) -> list[dict[str, Any]]:
    """A Responses input: a developer item, then per turn a user question, and on every third turn
    a function call with its output before the assistant's answer; ends on a user question."""
    items: list[dict[str, Any]] = [{"role": "developer", "content": "rule " * 30}]
    for turn in range(turns):
        items.append({"role": "user", "content": f"question{turn} " + "w " * (words - 1)})
        if turn % 3 == 1:
            call_id = f"call_{turn}"
            items.append(
                {"type": "function_call", "call_id": call_id, "name": "search", "arguments": f"turn {turn} places"}
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": "found " * words})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer{turn} " + "w " * (words - 1)}],
            }
        )
    items.append({"role": "user", "content": "and the last question"})
    return items
