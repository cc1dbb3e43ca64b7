"""What one `data:` payload of an OpenAI chat-completions stream means for the timings.

The definitions (README "Load testing"):

- a **token chunk** is a `chat.completion.chunk` with at least one choice, except the role
  announcement (a delta with `role` and no text, which vLLM sends just before the first token);
- a token chunk **has text** when a delta carries non-empty `content`, `reasoning_content` /
  `reasoning`, or `tool_calls`;
- a chunk with `usage` carries the server's token counts (`stream_options.include_usage`);
- `[DONE]` ends a complete stream; `{"error": ...}` is an error reported inside the stream.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

try:  # orjson parses a chunk several times faster; errors are ValueErrors either way
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is optional
    from json import loads as _loads


class ChunkKind(enum.Enum):
    DONE = "done"
    ERROR = "error"
    ROLE = "role"
    TOKEN = "token"
    USAGE = "usage"
    OTHER = "other"


@dataclass(frozen=True)
class Chunk:
    """The meaning of one SSE `data:` payload."""

    kind: ChunkKind
    text: str = ""
    has_text: bool = False
    usage: dict | None = None
    error: str | None = None
    finish_reason: str | None = None


def interpret(data: str) -> Chunk:
    """Classify one SSE `data:` payload of a chat-completions stream. Never raises."""
    if data.strip() == "[DONE]":
        return Chunk(ChunkKind.DONE)
    try:
        payload = _loads(data)
    except ValueError:
        return Chunk(ChunkKind.ERROR, error=f"invalid JSON in stream: {data[:200]!r}")
    if not isinstance(payload, dict):
        return Chunk(ChunkKind.ERROR, error=f"unexpected stream payload: {data[:200]!r}")
    if payload.get("error") is not None:
        return Chunk(ChunkKind.ERROR, error=error_message(payload))
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else None
    choices = payload.get("choices") or []
    if not isinstance(choices, list) or not choices:
        return Chunk(ChunkKind.USAGE if usage else ChunkKind.OTHER, usage=usage)

    text_parts: list[str] = []
    has_text = False
    announces_role = False
    finish_reason = None
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        finish_reason = choice.get("finish_reason") or finish_reason
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            continue
        announces_role = announces_role or "role" in delta
        content = delta.get("content")
        if isinstance(content, str) and content:
            text_parts.append(content)
            has_text = True
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str) and delta[key]:
                has_text = True
        if delta.get("tool_calls"):
            has_text = True
    if announces_role and not has_text and finish_reason is None:
        return Chunk(ChunkKind.ROLE, usage=usage)
    return Chunk(
        ChunkKind.TOKEN,
        text="".join(text_parts),
        has_text=has_text,
        usage=usage,
        finish_reason=finish_reason,
    )


def error_message(payload: object) -> str:
    """The human message of an OpenAI error envelope (`{"error": {"message": ...}}`), best effort."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail") or json.dumps(error)[:300]
            code = error.get("code") or error.get("type")
            return f"{message} ({code})" if code else str(message)
        if isinstance(error, str):
            return error
        detail = payload.get("detail")
        if detail:
            return str(detail)[:300]
    return str(payload)[:300]
