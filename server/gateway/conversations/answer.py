"""Reading an engine's Responses answer on its way to the client, for the store.

`AnswerTap` wraps the ASGI `send` of one Responses create. A whole answer (JSON) is held until
its body is complete, given back the fields the gateway changed on the way (records.client_response)
and sent with its new length. A stream is passed on event by event: the few lifecycle events
that carry the response object (`response.created`, `.in_progress`, `.completed`,
`.incomplete`, `.failed`) are given the same fields, every other event goes out as it came;
the output items of `response.output_item.done` are kept, so that a stream cut short (a client
that left, an engine that died) is recorded `incomplete` with the items that were whole. At
most one unfinished event is held (an event split across two chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.gateway.http.asgi import Message, Send
from server.gateway.jsonio import dumps, loads

Patch = Callable[[dict[str, Any]], dict[str, Any]]

_END = b"\n\n"
_LIFECYCLE = frozenset(
    {"response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"}
)
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
MAX_EVENT_BYTES = 64 * 2**20  # one event held whole at most (a final response object with its output)


def event_type(event: bytes) -> str | None:
    """The `event:` line of one SSE event, or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip().decode("latin-1")
    return None


def event_data(event: bytes) -> Any:
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return loads(b"\n".join(lines))
    except ValueError:
        return None


class AnswerTap:
    """The `send` of one Responses create, reading the answer for its record (see the module doc)."""

    def __init__(self, send: Send, patch: Patch, *, stream: bool) -> None:
        self._send = send
        self._patch = patch
        self.stream = stream
        self.status: int | None = None
        self.final: dict[str, Any] | None = None  # the response object of a finished answer
        self.done_items: list[Any] = []  # a stream's whole output items so far
        self.ended = False  # the engine's answer reached its end (a terminal event or the whole body)
        self._head: Message | None = None
        self._body: list[bytes] = []
        self._tail = b""

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            if self.status == 200 and not self._is_stream(message):
                self._head = message  # held until the body is whole (its length changes)
                return
            await self._send(message)
            return
        if kind != "http.response.body" or self.status != 200:
            await self._send(message)
            return
        if self._head is not None:
            await self._whole(message)
            return
        body = message.get("body", b"")
        out = self._events(body) if body else b""
        if not message.get("more_body", False) and self._tail:
            out += self._tail  # an unfinished last event: passed on as it came
            self._tail = b""
        await self._send({**message, "body": out})

    def _is_stream(self, message: Message) -> bool:
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type":
                return bytes(value).lower().startswith(b"text/event-stream")
        return self.stream

    async def _whole(self, message: Message) -> None:
        self._body.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        content = b"".join(self._body)
        self._body = []
        try:
            answer = loads(content)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            answer = self._patch(answer)
            self.final, self.ended = answer, True
            content = dumps(answer)
        head = self._head
        assert head is not None
        self._head = None
        headers = [(k, v) for k, v in head.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(content)).encode()))
        await self._send({**head, "headers": headers})
        await self._send({"type": "http.response.body", "body": content, "more_body": False})

    def _events(self, chunk: bytes) -> bytes:
        if self._tail:
            chunk, self._tail = self._tail + chunk, b""
        cut = chunk.rfind(_END)
        if cut == -1:
            if len(chunk) > MAX_EVENT_BYTES:
                return chunk  # not SSE as vLLM sends it: passed on untouched
            self._tail = chunk
            return b""
        whole, self._tail = chunk[: cut + 2], chunk[cut + 2 :]
        if whole.find(b"event: response.") == -1:
            return whole  # deltas only (most chunks)
        out = []
        for event in whole.split(_END)[:-1]:
            out.append(self._event(event) + _END)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        kind = event_type(event)
        if kind == "response.output_item.done":
            data = event_data(event)
            if isinstance(data, dict) and "item" in data:
                self.done_items.append(data["item"])
            return event
        if kind not in _LIFECYCLE:
            return event
        data = event_data(event)
        if not isinstance(data, dict) or not isinstance(data.get("response"), dict):
            return event
        data["response"] = response = self._patch(data["response"])
        if kind in _TERMINAL:
            self.final, self.ended = response, True
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data)
