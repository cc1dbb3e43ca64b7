"""The stand-in's token counting: deterministic, so that callers can predict every count.

A chat message costs 4 + its whitespace-separated words, the generation prompt 3, and a plain
prompt its words. Every generated token is one word, so a reply of n tokens has n words.
"""

from __future__ import annotations

import json
from typing import Any

from standin.config import GENERATION_PROMPT_TOKENS, TOKENS_PER_MESSAGE


def _words(text: Any) -> int:
    if isinstance(text, str):
        return len(text.split())
    if isinstance(text, list):  # content parts
        return sum(_words(part.get("text", "")) for part in text if isinstance(part, dict))
    return 0


def count_message_tokens(message: dict) -> int:
    """Tokens of one chat message: 4 + words of its content, name and tool calls."""
    count = TOKENS_PER_MESSAGE + _words(message.get("content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {} if isinstance(call, dict) else {}
        count += 1 + _words(function.get("name", "")) + _words(function.get("arguments", ""))
    return count


def count_chat_tokens(messages: list[dict], add_generation_prompt: bool = True) -> int:
    """The stand-in's prompt token count of a chat request (what /tokenize and usage report)."""
    total = sum(count_message_tokens(message) for message in messages)
    return total + (GENERATION_PROMPT_TOKENS if add_generation_prompt else 0)


def count_prompt_tokens(prompt: Any) -> int:
    """Tokens of a /v1/completions or /tokenize `prompt`: words of a string, or token ids."""
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(_words(item) for item in prompt)
    if isinstance(prompt, list):
        return len(prompt)
    return 0


def prompt_words(body: dict) -> list[str]:
    """The words the prefix cache hashes: each message as `<role>` then its words, or the prompt's."""
    if "messages" in body:
        words: list[str] = []
        for message in body["messages"]:
            words.append(f"<{message.get('role')}>")
            content = message.get("content")
            words.extend(content.split() if isinstance(content, str) else [json.dumps(content)])
        return words
    prompt = body.get("prompt")
    return prompt.split() if isinstance(prompt, str) else [json.dumps(prompt)]
