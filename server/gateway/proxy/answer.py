"""What the client of a proxied request is sent: the answer's head, a whole answer, and the endings
of an answer a deadline, a stalled client or the server's shutdown cut short.

`ClientAnswer` is the client's side of an `Exchange` (proxy.exchange), which adds the engine's
side: routing, retries, the attempt and the stream relay. A deadline or a disconnect cancels the
request's task (proxy.deadlines); `Exchange.run` then calls `_on_deadline` here, after the
upstream response was closed.
"""

from __future__ import annotations

import logging

from server.gateway.errors import UpstreamFailed, UpstreamTimeout, send_error
from server.gateway.http.asgi import Headers, Message, Send
from server.gateway.http.seam import ChunkedWriter, SendWriter, abort_connection, send_whole
from server.gateway.observability.record import CLIENT_CLOSED, CLIENT_STALLED, RequestRecord
from server.gateway.proxy.context import ProxyContext
from server.gateway.proxy.deadlines import Deadlines, Reason
from server.gateway.proxy.headers import DROPPED_RESPONSE_HEADERS
from server.gateway.proxy.hidden_usage import HiddenUsage
from server.gateway.request.request import GatewayRequest

log = logging.getLogger("gateway.proxy")


class ClientAnswer:
    """The client's side of one proxied request (see the module doc)."""

    __slots__ = ("context", "deadlines", "hidden", "last", "record", "request", "send", "stalled", "writer")

    def __init__(self, context: ProxyContext, request: GatewayRequest, record: RequestRecord, send: Send) -> None:
        self.context = context
        self.request = request
        self.record = record
        self.send = send
        self.deadlines: Deadlines | None = None
        self.last = b""  # the last chunk relayed, kept when a deadline cuts a stream (its error event follows it)
        self.hidden: HiddenUsage | None = None  # usage taken out of the stream (proxy.hidden_usage)
        self.stalled = False  # a deadline cut the stream while the client was not taking its chunks
        self.writer: ChunkedWriter | SendWriter | None = None  # the stream's body, once it started

    def _take_held(self) -> bytes:
        """What must go out before the next `send`: chunks written and not yet sent (http.seam's
        writers), then bytes the usage filter held back (see proxy.hidden_usage)."""
        out = self.writer.release() if self.writer is not None else b""
        hidden = self.hidden
        if hidden is None:
            return out
        out += hidden.rest + hidden.take()
        hidden.rest = b""
        return out

    def _head(self, status: int, upstream_headers: Headers, content_length: int | None = None) -> Message:
        """The `http.response.start` message of the client's answer (from now on the response has started)."""
        request = self.request
        headers = [(k, v) for k, v in upstream_headers if k.lower() not in DROPPED_RESPONSE_HEADERS]
        if content_length is not None:
            headers.append((b"content-length", str(content_length).encode()))
        request.sent()  # (done already, unless the engine was never reached)
        headers.extend(request.response_headers)
        headers.append((b"x-request-id", request.request_id.encode()))
        self.record.status = status
        self.record.started = True
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def _respond(self, status: int, upstream_headers: Headers, content: bytes) -> None:
        await send_whole(self.send, self._head(status, upstream_headers, len(content)), content)

    async def _on_deadline(self, reason: Reason) -> None:
        """A deadline passed or the client left (the upstream response is closed already)."""
        record = self.record
        if reason == "disconnect":
            record.status, record.error = CLIENT_CLOSED, "client disconnected"
            return
        t = self.context.settings.timeouts
        if self.stalled and record.started:
            await self._cut_stalled_client(reason, t.idle if reason == "idle" else t.total)
            return
        name, limit = {
            "first_byte": ("first byte", t.first_byte),
            "idle": ("idle", t.idle),
            "total": ("total", t.total),
        }[reason]
        where = f" {record.engine}" if record.engine else ""
        exc = UpstreamTimeout(f"Engine{where} exceeded the gateway's {name} timeout of {limit:g} s.")
        record.error = exc.message
        log.warning("request %s: %s", record.request_id, exc.message)
        if not record.started:
            record.status = exc.status
            exc.headers.append((b"x-request-id", self.request.request_id.encode()))
            await send_error(self.send, exc)
        else:
            held = self._take_held()
            event = self.request.endpoint.stream_format.error_event(exc, self.last)
            await self.send({"type": "http.response.body", "body": held + event, "more_body": False})

    async def _cut_stalled_client(self, reason: Reason, limit: float) -> None:
        """The deadline passed while the relay waited for the client to take a chunk: the client, not
        the engine, stopped the stream. Nothing more can reach it (an error event would wait behind
        the unsent bytes too): its connection is closed at once."""
        record = self.record
        record.status = CLIENT_CLOSED
        if reason == "idle":
            record.error = (
                f"{CLIENT_STALLED}: the client took none of the stream for the gateway's idle timeout "
                f"of {limit:g} s; its connection was closed"
            )
        else:
            record.error = (
                f"{CLIENT_STALLED}: the gateway's total timeout of {limit:g} s passed while the client "
                "was not reading; its connection was closed"
            )
        log.warning("request %s: %s", record.request_id, record.error)
        abort_connection(self.send)

    async def _end_stream_on_shutdown(self) -> None:
        """The server's grace period is over: end a started stream properly instead of cutting it."""
        record = self.record
        if record.started and self.request.stream:
            exc = UpstreamFailed(
                "The gateway is shutting down; the stream was cut at its grace deadline.", code="gateway_shutdown"
            )
            record.error = exc.message
            try:
                event = self._take_held() + self.request.endpoint.stream_format.error_event(exc, self.last)
                await self.send({"type": "http.response.body", "body": event, "more_body": False})
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        else:
            record.status, record.error = record.status or 503, "gateway shutting down"
