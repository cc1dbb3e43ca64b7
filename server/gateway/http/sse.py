"""Cheap looks into the engine's SSE bytes as they stream past, without parsing every chunk.

The gateway forwards the engine's stream byte for byte. It only needs to know two things
from it: when the first real token passes (time to first token, inter-token latency), and the
token usage of the final chunk (chat) or of the `response.completed` event (Responses API; see
streams.py for the two dialects). Both are found with `bytes.find` on the raw chunk; JSON is
parsed once, for the last event that carries `usage`. A network read may hold several events or part
of one; `UsageScanner` keeps an unfinished event until the next read completes it. A stream
whose client did not ask for usage goes through `hidden_usage.HiddenUsage` instead, which also
takes the usage chunk out.
"""

from __future__ import annotations

from typing import Any

from server.gateway.jsonio import loads

_QUOTE = 0x22
_SPACE = 0x20
# `content":` also matches `reasoning_content":`; `"text":` is the completions API's token.
_TOKEN_MARKERS = (b'content":', b'"text":')
_TOOL_MARKERS = (b'"tool_calls":[{', b'"tool_calls": [{')
USAGE_MARKER = b'"usage":'
MAX_USAGE_BUFFER = 1 << 20


_CONTENT_STRING = b'content":"'  # vLLM's compact JSON: the common case, one `find`
_CONTENT_AT = len(_CONTENT_STRING)
_EMPTY_CONTENT = b'content":""'
_CONTENT_KEY = _TOKEN_MARKERS[0]
_TEXT_KEY = _TOKEN_MARKERS[1]
_TOOL_KEY = b'"tool_calls":'  # (both _TOOL_MARKERS start with it)


def has_token(chunk: bytes) -> bool:
    """True if any event in `chunk` carries a non-empty content/text string or a tool call."""
    # The last content string is not empty: most chunks of a stream stop here (`rfind`: cheaper than
    # `find` for this needle, and vLLM's delta is nearer the end of an event than its start).
    i = chunk.rfind(_CONTENT_STRING) + _CONTENT_AT
    if _CONTENT_AT <= i < len(chunk) and chunk[i] != _QUOTE:
        return True
    # The other chunks of a chat stream (the role's, the finish reason's, the usage, `[DONE]`) hold
    # no text key, no tool calls and only empty compact content strings: told by scans in C
    # (`rfind`, not `in`: `bytes.__contains__` costs twice as much on chunks this short).
    if chunk.rfind(_TEXT_KEY) == -1 and chunk.rfind(_TOOL_KEY) == -1:
        contents = chunk.count(_CONTENT_KEY)
        if not contents or contents == chunk.count(_EMPTY_CONTENT):
            return False
    return scan_for_token(chunk)


def scan_for_token(chunk: bytes) -> bool:
    """`has_token` without its shortcuts: every marker looked at, spaces after colons allowed."""
    for marker in _TOKEN_MARKERS:
        i = chunk.find(marker)
        while i != -1:
            j = i + len(marker)
            n = len(chunk)
            while j < n and chunk[j] == _SPACE:
                j += 1
            if j + 1 < n and chunk[j] == _QUOTE and chunk[j + 1] != _QUOTE:
                return True
            i = chunk.find(marker, j)
    return _TOOL_MARKERS[0] in chunk or _TOOL_MARKERS[1] in chunk


def usage_object_follows(chunk: bytes, start: int = 0) -> int:
    """Index of a `"usage":` followed by an object (not null), or -1."""
    i = chunk.find(USAGE_MARKER, start)
    while i != -1:
        j = i + len(USAGE_MARKER)
        while j < len(chunk) and chunk[j] == _SPACE:
            j += 1
        if j < len(chunk) and chunk[j] == 0x7B:  # {
            return i
        i = chunk.find(USAGE_MARKER, j)
    return -1


def _usage_of(payload: object) -> dict[str, Any] | None:
    """`payload["usage"]`, or the Responses API's `payload["response"]["usage"]` (response.completed)."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if usage is None and isinstance(response := payload.get("response"), dict):
        usage = response.get("usage")
    return usage if isinstance(usage, dict) else None


def usage_from_event(event: bytes) -> dict[str, Any] | None:
    """The `usage` object of one SSE event (`data: {...}`, maybe after an `event:` line), or None."""
    start = event.find(b"data:")
    if start == -1 or event[:start].strip() and not event[:start].lstrip().startswith(b"event:"):
        return None
    try:
        payload = loads(event[start + 5 :])
    except ValueError:
        return None
    return _usage_of(payload)


class UsageScanner:
    """Finds the last `usage` object in a stream of SSE bytes, parsing only the last event that has one.

    Per chunk it costs an `endswith` and a `find`: a chunk holding a usage object is kept (its
    complete events), and parsed once, in `finish` (with `continuous_usage_stats` every chunk has
    one; only the last counts). An event split across two reads is kept (bounded) and completed by
    the next read.
    """

    __slots__ = ("_last", "_tail", "usage")

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self._tail = b""
        self._last = b""  # the complete events of the last chunk that held a usage object

    def feed(self, chunk: bytes) -> bytes:
        """Look at `chunk`; returns it (all of it goes to the client)."""
        if not self._tail and chunk.endswith(b"\n\n"):  # whole events: the common case
            if chunk.rfind(USAGE_MARKER) != -1 and usage_object_follows(chunk) != -1:  # (rfind: cheaper)
                self._last = chunk
            return chunk
        given = chunk
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            cut = cut + 2 if cut != -1 else 0
            if len(chunk) - cut <= MAX_USAGE_BUFFER:  # else: not SSE we understand; drop it
                self._tail = chunk[cut:]
            chunk = chunk[:cut]
        if usage_object_follows(chunk) != -1:
            self._last = chunk
        return given

    def finish(self) -> dict[str, Any] | None:
        """The usage of the last event that carried one, after also trying an unterminated final event."""
        if self._last:
            for event in reversed(self._last.split(b"\n\n")):
                if usage_object_follows(event) != -1 and (usage := usage_from_event(event)) is not None:
                    self.usage = usage
                    break
            self._last = b""
        if self._tail:
            usage = usage_from_event(self._tail)
            if usage is not None:
                self.usage = usage
            self._tail = b""
        return self.usage


def usage_from_body(body: bytes) -> dict[str, Any] | None:
    """The `usage` of a complete (non-streaming) JSON answer, or None."""
    if usage_object_follows(body) == -1:
        return None
    try:
        payload = loads(body)
    except ValueError:
        return None
    return _usage_of(payload)


def ends_with_done(chunk: bytes) -> bool:
    return chunk.rstrip().endswith(b"data: [DONE]")
