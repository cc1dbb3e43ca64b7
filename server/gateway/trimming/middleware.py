"""The old ASGI form of history trimming, kept until the router calls `HistoryTrimming` itself.

`TrimmingMiddleware` reads a POST to the chat path, parses it into a `GatewayRequest` and hands
it to the step (`server.gateway.trimming.step.HistoryTrimming`), then forwards the (possibly
rewritten) body to the app with the step's `x-trim-*` headers on the response. A body it
cannot read whole or parse passes through untouched, so the app reports it as usual.
"""

from __future__ import annotations

from typing import Any

from server.gateway.edge.asgi import ASGIApp, Headers, Message, Receive, Scope, Send
from server.gateway.edge.endpoints import BY_PATH
from server.gateway.edge.requests import parse_request
from server.gateway.errors import InvalidRequest, send_error
from server.gateway.trimming.counter import TokenCounter
from server.gateway.trimming.decision import MODES, TrimOutcome, effective_mode
from server.gateway.trimming.step import MODE_HEADER, HistoryTrimming, Lookup, TrimMetrics, accepts_tools

__all__ = ["MODES", "MODE_HEADER", "TrimmingMiddleware", "effective_mode"]

_accepts_tools = accepts_tools  # the old name, for tests/gateway/test_trimming_wiring.py until it moves


class TrimmingMiddleware:
    """History trimming in front of `app` for POSTs to `path` (see module doc)."""

    def __init__(
        self,
        app: ASGIApp | None,
        *,
        lookup: Lookup,
        metrics: TrimMetrics | None = None,
        counter: TokenCounter | None = None,
        max_body_bytes: int = 32 * 2**20,
        path: str = "/v1/chat/completions",
    ) -> None:
        self.app = app
        self.step = HistoryTrimming(lookup=lookup, metrics=metrics, counter=counter)
        self.max_body_bytes = max_body_bytes
        self.path = path

    @property
    def counter(self) -> TokenCounter:
        return self.step.counter

    @property
    def counting_in_background(self) -> int:
        return self.step.counting_in_background

    async def _decide(self, body: dict[str, Any], requested: str | None) -> TrimOutcome | None:
        """The step's decision for a parsed body (for callers still holding this class)."""
        model = body.get("model")
        if not isinstance(model, str):
            return None
        outcome = await self.step.outcome(model, body, requested)
        if outcome is not None and outcome.kept is not None and self.step.metrics is not None:
            self.step.metrics.trimmed(model, outcome.dropped_messages, outcome.dropped_tokens)
        return outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "TrimmingMiddleware needs an app to forward to"
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        chunks, complete = await _read_body(receive, self.max_body_bytes)
        if chunks is None:  # the client left while sending
            return
        body = b"".join(chunks)
        if not complete:
            await self.app(scope, _replay(body, receive, more_body=True), send)
            return
        try:
            request = parse_request(body, BY_PATH[self.path], headers=list(scope.get("headers", [])))
        except (InvalidRequest, KeyError):
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            await self.step(request)
        except InvalidRequest as exc:
            await send_error(send, exc)
            return
        if request.raw is not body:
            scope = dict(scope, headers=_with_length(scope["headers"], len(request.raw)))
        await self.app(scope, _replay(request.raw, receive), _adding_headers(send, request.response_headers))


async def _read_body(receive: Receive, limit: int) -> tuple[list[bytes] | None, bool]:
    """The request body's chunks, and whether it was read whole (False: over `limit`)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, False
        chunk: bytes = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return chunks, True
        if size > limit:
            return chunks, False


def _replay(body: bytes, receive: Receive, *, more_body: bool = False) -> Receive:
    """A receive that hands the app `body` first, then whatever the client sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more_body}
        return await receive()

    return replay


def _adding_headers(send: Send, headers: Headers) -> Send:
    if not headers:
        return send

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *headers])
        await send(message)

    return wrapped


def _with_length(headers: Headers, length: int) -> Headers:
    kept = [(k, v) for k, v in headers if k.lower() not in {b"content-length", b"transfer-encoding"}]
    return [*kept, (b"content-length", str(length).encode())]
