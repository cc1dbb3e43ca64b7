"""The few body checks the gateway makes before it picks an engine, each naming the OpenAI `param`.

The gateway checks only what it needs to route and to answer in the right shape; everything
else is the engine's business and passes through untouched, so the engine's own validation
errors reach the client unchanged.
"""

from __future__ import annotations

from typing import Any

from server.gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # deeper nesting is refused before any code walks the body recursively


def type_name(value: object) -> str:
    names: dict[type, str] = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def wrong_type(param: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(f"`{param}` must be {expected}, got {type_name(value)}.", param=param, code="invalid_type")


def missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: `{param}`.", param=param, code="missing_required_parameter")


def check_depth(value: object, limit: int = MAX_JSON_DEPTH, *, raw: bytes | None = None) -> None:
    """Refuse JSON nested deeper than `limit`, level by level (no recursion on the client's input).

    With the `raw` text `value` was parsed from, a text with no more `{` and `[` than `limit` is
    passed without the walk: it cannot nest deeper (the usual request, for one `count` each)."""
    if raw is not None and raw.count(b"{") + raw.count(b"[") <= limit:
        return
    level: list[object] = [value]
    depth = 1
    while level:
        if depth > limit:
            raise InvalidRequest(f"The request body is nested deeper than {limit} levels.", code="invalid_json")
        deeper: list[object] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:  # type: ignore[attr-defined]
                if type(child) is dict or type(child) is list:
                    deeper.append(child)
        level = deeper
        depth += 1


def check_messages(body: dict[str, Any]) -> None:
    """Chat: a non-empty array of message objects, each with a string `role`."""
    messages = body.get("messages")
    if messages is None:
        raise missing("messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array of message objects", messages)
    if not messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages", code="invalid_value")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise wrong_type(f"messages[{i}]", "an object", message)
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"`messages[{i}].role` must be a string.", param=f"messages[{i}].role", code="invalid_type"
            )


def check_prompt(body: dict[str, Any]) -> None:
    """Completions: `prompt` is a string or a non-empty array."""
    prompt = body.get("prompt")
    if prompt is None:
        raise missing("prompt")
    if not isinstance(prompt, (str, list)):
        raise wrong_type("prompt", "a string or an array", prompt)
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequest("`prompt` must not be an empty array.", param="prompt", code="invalid_value")
