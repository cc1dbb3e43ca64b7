"""A request's conversation as trimming sees it: the chat messages its engine renders, and how to
send fewer of them, for each endpoint that trims history.

Trimming decides on chat messages (`core`, `watermark`, `decision`) counted by the engine's
``/tokenize`` with ``messages``. A chat request is that list already. A Responses request
(``/v1/responses``) is an ``input`` (a string, or a list of items: messages, ``function_call``,
``function_call_output``, ``reasoning``, ...) plus ``instructions``; vLLM turns it into chat
messages before applying the chat template (vllm/entrypoints/openai/responses/utils.py,
``construct_input_messages``), and `responses_history` does the same, remembering which items
each message came from, so that a cut between messages becomes a cut between items:

- ``instructions`` becomes a leading system message (always kept: it is not part of ``input``);
- a message item keeps its role; an assistant message's text (its first content part, as vLLM
  reads it) joins the assistant message before it when that one has no text yet;
- a ``function_call`` joins the assistant message before it as one of its ``tool_calls`` (else
  starts one), a ``function_call_output`` is a ``tool`` message with the call's id, so a call and
  its output are kept or dropped together like a chat tool call and its result;
- a ``reasoning`` item is the ``reasoning`` of an assistant message, joined the same way.

Text parts (`input_text`, `output_text`) are counted as chat `text` parts, which is how vLLM reads
them. An input trimming cannot read the same way (another item type, an item that is not an
object, encrypted reasoning, a message with image, file or audio parts) is not trimmed:
`responses_history` answers None and the request passes untouched, for the engine to judge.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.gateway.trimming.core import Message, leading_instructions

# Where a request says how many tokens its answer may take, first found wins.
CHAT_ANSWER_KEYS = ("max_completion_tokens", "max_tokens")
RESPONSES_ANSWER_KEYS = ("max_output_tokens",)


@dataclass(frozen=True)
class History:
    """One request's conversation, as chat messages, and how to write a trimmed one back.

    `rebuild(head, cut)` is the request body keeping `messages[:head] + messages[cut:]`, and how
    many of the client's units (chat messages, Responses items) that drops.
    """

    messages: list[Message]
    generation_prompt: bool  # the template adds the assistant's generation prompt
    tools: list[Any] | None  # tool definitions in chat form (templates render them), or None
    answer_keys: tuple[str, ...]
    rebuild: Callable[[int, int], tuple[dict[str, Any], int]]
    param: str = "messages"  # the request's field that holds the conversation (named in a refusal)

    def trimmed(self, dropped_messages: int) -> tuple[dict[str, Any], int]:
        """The body without the `dropped_messages` messages trimming cut after the instructions."""
        head = leading_instructions(self.messages)
        return self.rebuild(head, head + dropped_messages)


def chat_history(body: dict[str, Any]) -> History | None:
    """A chat completions request's `messages` (None unless a non-empty list of role objects)."""
    messages = body.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        return None
    generation_prompt = bool(body.get("add_generation_prompt", True)) and not body.get("continue_final_message", False)
    tools = body.get("tools")

    def rebuild(head: int, cut: int) -> tuple[dict[str, Any], int]:
        return {**body, "messages": messages[:head] + messages[cut:]}, cut - head

    return History(
        messages=messages,
        generation_prompt=generation_prompt,
        tools=tools if isinstance(tools, list) and tools else None,
        answer_keys=CHAT_ANSWER_KEYS,
        rebuild=rebuild,
    )


def hides_history(body: dict[str, Any]) -> bool:
    """The engine prepends a conversation the gateway never sees: a stored response's
    (`previous_response_id`), or vLLM's `previous_input_messages`."""
    return body.get("previous_response_id") is not None or body.get("previous_input_messages") is not None


def responses_history(body: dict[str, Any]) -> History | None:
    """A Responses request's `instructions` + `input` as vLLM renders them (see the module doc);
    None when the input is not one trimming can read."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return None
    raw_input = body.get("input")
    converted: list[tuple[Message, int]] | None
    if isinstance(raw_input, str):
        items: list[Any] = [raw_input]
        converted = [({"role": "user", "content": raw_input}, 0)]
    elif isinstance(raw_input, list) and raw_input:
        items = raw_input
        converted = to_chat(raw_input)
    else:
        return None
    if converted is None:
        return None
    messages: list[Message] = []
    starts: list[int] = []  # starts[j]: the index in `items` of message j's first item
    if instructions:
        messages.append({"role": "system", "content": instructions})
        starts.append(0)
    for message, start in converted:
        messages.append(message)
        starts.append(start)
    starts.append(len(items))

    def rebuild(head: int, cut: int) -> tuple[dict[str, Any], int]:
        kept = items[: starts[head]] + items[starts[cut] :]
        return {**body, "input": kept}, starts[cut] - starts[head]

    return History(
        messages=messages,
        generation_prompt=not _continues_final_message(items),
        tools=chat_tools(body.get("tools")),
        answer_keys=RESPONSES_ANSWER_KEYS,
        rebuild=rebuild,
        param="input",
    )


def to_chat(items: Sequence[Any]) -> list[tuple[Message, int]] | None:
    """The chat messages vLLM builds from Responses input `items`, each with the index of its first
    item (a message spans the items from there to the next one's); None for an item trimming
    cannot read."""
    out: list[tuple[Message, int]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            return None
        previous = out[-1][0] if out and out[-1][0].get("role") == "assistant" else None
        kind = item.get("type")
        if kind in ("function_call", "custom_tool_call"):
            call = _tool_call(item)
            if call is None:
                return None
            if previous is not None:
                previous.setdefault("tool_calls", []).append(call)
                continue
            out.append(({"role": "assistant", "tool_calls": [call]}, index))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            result = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            out.append(({"role": "tool", "content": result, "tool_call_id": item.get("call_id")}, index))
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                return None  # vLLM refuses it
            reasoning = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
            if previous is not None and previous.get("reasoning") is None:
                previous["reasoning"] = reasoning
                continue
            out.append(({"role": "assistant", "reasoning": reasoning}, index))
        elif kind in (None, "message") and item.get("role") == "assistant":
            content = item.get("content")
            text: str | None = content if isinstance(content, str) else _first_text(content)
            if text is None:
                return None
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
                continue
            out.append(({"role": "assistant", "content": text}, index))
        elif kind in (None, "message") and isinstance(item.get("role"), str):
            content = _chat_content(item.get("content"))
            if content is None:
                return None
            out.append(({"role": item["role"], "content": content}, index))
        else:
            return None  # item references, built-in tool calls, ...: not trimmed
    return out


def chat_tools(tools: Any) -> list[Any] | None:
    """Responses function tools (`{"type": "function", "name", ...}`) in the chat form templates
    render; None without any."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str):
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            out.append({"type": "function", "function": function})
    return out or None


def _chat_content(content: Any) -> str | list[dict[str, Any]] | None:
    """A message item's content as chat content: text parts (`input_text`, `output_text`) become
    chat `text` parts, as vLLM's parser reads them (``/tokenize`` refuses the Responses names).
    None for other parts (images, files, audio): such an input is not trimmed."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            return None
        parts.append({"type": "text", "text": part["text"]})
    return parts


_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _tool_call(item: dict[str, Any]) -> dict[str, Any] | None:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        return None
    arguments = item.get("arguments") if item.get("type") == "function_call" else item.get("input")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False) if arguments is not None else ""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts and isinstance(parts[0], dict):
        text = parts[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _continues_final_message(items: Sequence[Any]) -> bool:
    """vLLM continues an unfinished last assistant message or reasoning instead of starting a turn."""
    last = items[-1] if items else None
    if not isinstance(last, dict) or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")
