"""The two SSE dialects engines stream in, as the proxy needs to know them.

    dialect     endpoints                                  a token is                  it ends with
    chat        chat, completions, audio transcriptions    non-empty content/text      data: [DONE]
    responses   /v1/responses (create, retrieve?stream)    any `*.delta` event         response.completed
                                                                                       (or .failed/.incomplete)
    anthropic   /v1/messages                               non-empty text (as chat)    message_stop

Per streamed chunk the proxy calls `has_token` only (chat: `http.sse.has_token`; responses: one
`bytes.find`). `finished` and `error_event` run once, when a stream breaks: an engine that dies
mid-stream, or a deadline, ends the client's stream with an error in the stream's own dialect
(chat: `data: {"error": ...}` then `data: [DONE]`; responses: an `error` event, which the OpenAI
SDK yields as a `ResponseErrorEvent`; anthropic: an `error` event as Anthropic's API sends one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from server.gateway.errors import GatewayError, stream_error_event
from server.gateway.http.sse import ends_with_done, has_token

# `"type":"response.output_text.delta"` and every other delta event (tool-call arguments,
# reasoning text, refusals): text in a JSON string has its quotes escaped, so `.delta"` cannot
# come from the model's own output.
_RESPONSES_DELTA = b'.delta"'
_RESPONSES_ENDS = (b'"response.completed"', b'"response.failed"', b'"response.incomplete"')
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


@dataclass(frozen=True, slots=True)
class StreamFormat:
    """How one family of endpoints streams (see the module doc)."""

    name: str
    has_token: Callable[[bytes], bool]  # per chunk: does it carry generated output?
    finished: Callable[[bytes], bool]  # the last chunk shows the stream ended on its own
    error_event: Callable[[GatewayError, bytes], bytes]  # (error, last chunk) -> the bytes that end the stream


def responses_has_token(chunk: bytes) -> bool:
    """True if `chunk` holds a Responses delta event (output text, tool-call arguments, reasoning)."""
    return chunk.find(_RESPONSES_DELTA) != -1


def responses_finished(chunk: bytes) -> bool:
    return any(marker in chunk for marker in _RESPONSES_ENDS)


def responses_error_event(exc: GatewayError, last: bytes) -> bytes:
    """An `error` event of the Responses API, numbered after the last event the client received."""
    numbers = _SEQUENCE.findall(last)
    sequence = int(numbers[-1]) + 1 if numbers else 0
    event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": sequence}
    return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


CHAT = StreamFormat("chat", has_token, ends_with_done, lambda exc, last: stream_error_event(exc))
RESPONSES = StreamFormat("responses", responses_has_token, responses_finished, responses_error_event)


def anthropic_error_event(exc: GatewayError, last: bytes) -> bytes:
    event = {"type": "error", "error": {"type": "api_error", "message": exc.message}}
    return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


ANTHROPIC = StreamFormat("anthropic", has_token, lambda chunk: b'"message_stop"' in chunk, anthropic_error_event)
