"""One request forwarded to an engine replica (`Exchange`), and its answer relayed as it comes.

It sends the body bytes it is given (`GatewayRequest.raw`) and answers as the engine answers:
same status, same headers (minus hop-by-hop ones), same bytes. Streams are relayed chunk by
chunk as they arrive, spliced from the engine's connection into the client's (no ASGI message or
task step per chunk: `_relay_stream`); per chunk the only extra work is two `bytes.find` calls
(first token, usage). A streamed chat/completions request whose client did not ask for usage is sent with
`include_usage` anyway and its usage chunk is taken out of the client's stream (hidden_usage:
one more `find` per chunk), so that every stream's tokens are counted.

A tenant's request passes the flow gate first (server.gateway.flow, `context.flow`): at once
while the model's engines have room, else it waits there, ordered by class and fair share, until
room appears (429 past its class's wait or queue bounds); the client leaving meanwhile cancels it
like any other wait (deadlines), and nothing reaches an engine.

Failure handling, in the order a request meets it (`failures` has the table):
- connection refused/reset, or a 503, before any byte reached the client: another replica,
  up to `retries.max_attempts`, with doubling backoff (a refusing engine is also marked down);
  a request pinned to one replica (it asks for a response that replica stored, request.targets) has
  no other: when that replica is down or unreachable the answer is 404 response_not_found;
- no byte from the engine within `timeouts.first_byte` (response headers, and for a stream its
  first chunk; for a non-streaming request that is the whole answer): 504;
- more than `timeouts.idle` between two chunks, or `timeouts.total` overall, once streaming:
  the stream ends with an error in its own dialect (chat: `data: {"error": ...}` and
  `data: [DONE]`; Responses: an `error` event; see streams.py), like an engine failing mid-stream;
- the client leaving, at any point: the upstream response is closed, so vLLM aborts the
  request, within milliseconds;
- the idle or total deadline passing while the relay waits for the client to take a chunk (it
  stopped reading: flow control): that is the client's stall, not the engine's silence. Logged
  as `client_stalled` with status 499, and the client's connection is closed at once, since no
  error event could reach it (http.seam.abort_connection).
Deadlines and disconnects cancel the request's task (`deadlines`); `Exchange.attempt` owns the
upstream response and closes it on every path. An engine's error answer passes through with its
status; one that is not in the OpenAI envelope (an endpoint the engine does not serve) is put in one.
"""

from __future__ import annotations

import asyncio
import logging
from time import perf_counter

import httpx

from server.gateway.errors import (
    GatewayError,
    NoEngineAvailable,
    ResponseNotFound,
    engine_error_body,
)
from server.gateway.http.asgi import Headers, Receive, Send
from server.gateway.http.seam import start_body
from server.gateway.http.sse import UsageScanner, usage_from_body
from server.gateway.observability.record import RequestRecord
from server.gateway.proxy.answer import ClientAnswer
from server.gateway.proxy.bounded import AnswerTooLarge, read_bounded
from server.gateway.proxy.context import ProxyContext
from server.gateway.proxy.deadlines import Deadlines
from server.gateway.proxy.failures import Failure, Stage, upstream_failure
from server.gateway.proxy.headers import upstream_headers
from server.gateway.proxy.hidden_usage import HiddenUsage, hide_usage_from_client
from server.gateway.proxy.upstream import UpstreamResponse
from server.gateway.replicas.cache import PromptView
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import ModelPool
from server.gateway.replicas.routing import affinity_key
from server.gateway.request.request import GatewayRequest
from server.gateway.request.targets import body_for, excluded

log = logging.getLogger("gateway.proxy")


class _Retry(Exception):
    """This attempt failed before anything reached the client; another replica may do better."""

    def __init__(self, error: GatewayError, response: tuple[int, Headers, bytes] | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.response = response  # an engine's 503, passed through if no replica does better


class Exchange(ClientAnswer):
    """One client request and its answer, from routing to the last byte."""

    __slots__ = ("hide_usage",)

    def __init__(self, context: ProxyContext, request: GatewayRequest, record: RequestRecord, send: Send) -> None:
        super().__init__(context, request, record, send)
        self.hide_usage = False  # the engine is asked for usage the client did not ask for (proxy.hidden_usage)

    async def run(self, pool: ModelPool, receive: Receive) -> None:
        t = self.context.settings.timeouts
        task = asyncio.current_task()
        assert task is not None
        deadlines = self.deadlines = Deadlines(
            task, self.record.arrived, t.first_byte, t.idle, t.total, receive, self.send
        )
        self.hide_usage = hide_usage_from_client(self.request)
        try:
            await self._forward(pool)
        except asyncio.CancelledError:
            if deadlines.reason is None:  # not ours: the server is shutting down
                await self._end_stream_on_shutdown()
                raise
            task.uncancel()
            await self._on_deadline(deadlines.reason)
        finally:
            deadlines.close()

    async def _forward(self, pool: ModelPool) -> None:
        """The request's routing key and prompt, the flow gate (a tenant's request), then a replica."""
        routing = self.context.settings.routing
        key: bytes | None = None
        prompt: PromptView | None = None
        if pool.has_choice:
            key = affinity_key(
                self.request.body,
                session=self.request.header(routing.session_header.lower().encode()),
                prefix_affinity=routing.prefix_affinity,
                prefix_chars=routing.prefix_chars,
                prefix_min_chars=routing.prefix_min_chars,
            )
            prompt = await pool.prompt(routing, self.request.body, adapter=self.request.adapter)  # cache_aware only
        flow = self.context.flow
        if flow is not None and flow.applies(self.request, self.record):
            # The gate (server.gateway.flow): straight on while the engines have room, else queued.
            held = flow.pass_now(pool, self.request, self.record)
            if held is None:
                held, prompt = await flow.wait(pool, self.request, self.record, prompt)
            try:
                await self._route(pool, key, prompt)
            finally:
                flow.leave(held, self.record)
            return
        await self._route(pool, key, prompt)

    async def _route(self, pool: ModelPool, key: bytes | None, prompt: PromptView | None) -> None:
        """Try replicas until one answers; failures before the first byte move to the next one."""
        settings = self.context.settings
        routing = settings.routing
        attempts = settings.retries.max_attempts
        barred = excluded(self.request, pool)
        tried: list[Engine] = []
        failure: _Retry | None = None
        for attempt in range(attempts):
            decision = pool.route(routing, key=key, prompt=prompt, exclude=[*barred, *tried] if barred else tried)
            if decision is None:
                break
            engine = decision.engine
            tried.append(engine)
            self.record.engine = engine.id
            self.record.routing = decision
            try:
                await self.attempt(engine)
                return
            except _Retry as retry:
                failure = retry
                log.warning(
                    "request %s: engine %s failed before the first byte (%s)%s",
                    self.record.request_id,
                    engine.id,
                    retry.error.message,
                    "; retrying" if attempt + 1 < attempts else "",
                )
            finally:
                pool.release(engine)
            more = attempt + 1 < attempts
            if (
                more
                and settings.retries.backoff
                and any(e.healthy and e not in tried and e not in barred for e in pool.engines)
            ):
                await asyncio.sleep(settings.retries.backoff * 2**attempt)
        pin = self.request.pin
        if pin is not None and (
            failure is None or failure.response is None and isinstance(failure.error, NoEngineAvailable)
        ):
            which = self.request.response_id or self.request.body.get("previous_response_id")
            raise ResponseNotFound(
                f"Response with id '{which}' not found: the engine that stored it ({pin.id}) "
                "is down, and stored responses live in its memory.",
                param="response_id" if self.request.response_id else "previous_response_id",
            )
        if failure is None:
            adapter = f" serving adapter `{self.request.adapter}`" if self.request.adapter else ""
            raise NoEngineAvailable(f"No healthy engine for model `{pool.name}`{adapter} right now; try again shortly.")
        if failure.response is not None:  # the engine's own 503: the client sees it as the engine sent it
            status, headers, content = failure.response
            self.record.error = failure.error.message
            await self._respond(status, headers, content)
            return
        raise failure.error

    # -- one engine -------------------------------------------------------------------------------

    def _upstream_headers(self) -> Headers:
        return upstream_headers(self.request, self.context.forward_auth)

    def _failed(self, exc: httpx.HTTPError, engine: Engine, stage: Stage) -> Failure:
        failure = upstream_failure(exc, engine.id, engine.model, stage, self.context.connect_timeout)
        if failure.engine_down is not None:
            engine.mark_down(failure.engine_down)
        return failure

    def _raise(self, exc: httpx.HTTPError, engine: Engine, stage: Stage) -> None:
        failure = self._failed(exc, engine, stage)
        if failure.retry:
            raise _Retry(failure.error) from None
        raise failure.error from None

    async def attempt(self, engine: Engine) -> None:
        """Send the request to `engine` and relay its answer. Owns the upstream response: closed on every path."""
        context = self.context
        request = self.request
        endpoint = request.endpoint
        target = (
            context.target(engine, request.path, endpoint.method, cache=False)
            if request.path
            else context.target(engine, endpoint.path, endpoint.method)
        )
        response: UpstreamResponse | None = None
        try:
            try:
                response = await context.upstream.post(
                    target,
                    self._upstream_headers(),
                    body_for(request, engine),
                    connect_timeout=context.connect_timeout,
                    # what can wait is done while the engine works (GatewayRequest.sent)
                    sent=request.sent if request.late_work is not None or request.late_headers is not None else None,
                )
            except httpx.HTTPError as exc:
                self._raise(exc, engine, Stage.CONNECT)
            assert response is not None
            if response.status_code == 503:
                content = await self._read_whole(response, engine)
                raise _Retry(NoEngineAvailable(f"Engine {engine.id} answered 503."), (503, response.headers, content))
            if request.stream and response.status_code == 200:
                await self._relay_stream(response, engine)
            else:
                content = await self._read_whole(response, engine)
                if self.deadlines is not None:
                    self.deadlines.disarm()
                status, headers = response.status_code, response.headers
                if status == 200:
                    self.record.usage = usage_from_body(content)
                elif status >= 400 and (wrapped := engine_error_body(status, content)) is not None:
                    headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
                    headers.append((b"content-type", b"application/json"))
                    content = wrapped
                await self._respond(status, headers, content)
        finally:
            if response is not None:
                await response.aclose()

    async def _read_whole(self, response: UpstreamResponse, engine: Engine) -> bytes:
        """The engine's whole answer, within `limits.max_answer_bytes` (proxy.bounded)."""
        try:
            return await read_bounded(response, self.context.settings.limits.max_answer_bytes, engine.id)
        except AnswerTooLarge as exc:
            log.warning("request %s: %s", self.record.request_id, exc.message)
            raise
        except httpx.HTTPError as exc:
            self._raise(exc, engine, Stage.BODY)
            raise  # pragma: no cover - _raise always raises

    async def _relay_stream(self, response: UpstreamResponse, engine: Engine) -> None:
        """Relay an SSE stream chunk by chunk; a failure after the first chunk ends it with an error event.

        After the first chunk the engine's body is spliced into the client's connection: each chunk
        is handled by `sink`, called by the upstream connection as it parses the chunk, which
        stamps it (first token, inter-token latency, the idle deadline), takes the usage out when
        the client did not ask for it, and frames it for the client (http.seam's ChunkedWriter);
        after each read from the engine the writer is flushed in one write (several chunks that
        arrived together, under load, leave together). No ASGI message, future or task step per
        chunk; when the client's buffer is full the engine's socket is paused until it drains
        (the relay then waits on the client: a deadline passing there is the client's stall).
        """
        send = self.send
        record = self.record
        try:
            first = await response.read_chunk()
        except httpx.HTTPError as exc:
            self._raise(exc, engine, Stage.FIRST_CHUNK)
        writer = self.writer = await start_body(send, self._head(response.status_code, response.headers))
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.streaming(perf_counter())
        inter_token = self.context.metrics.inter_token_sink(self.request.model)
        stream_format = self.request.endpoint.stream_format
        has_token = stream_format.has_token
        # What the client gets of each chunk: all of it, or (usage it did not ask for) the chunk without it.
        hidden = self.hidden = HiddenUsage(self.context.fingerprints, engine.id) if self.hide_usage else None
        scanner: UsageScanner | HiddenUsage = hidden if hidden is not None else UsageScanner()
        feed = scanner.feed
        write = writer.write

        def sink(chunk: bytes) -> None:
            now = perf_counter()
            if deadlines is not None:
                deadlines.last = now
            if has_token(chunk):
                if record.first_token_at:
                    inter_token(now - record.last_token_at)
                    record.last_token_at = now
                else:
                    self._first_token(now)
            out = feed(chunk)
            if out:
                self.last = out
                write(out)

        async def drain() -> None:
            self.stalled = True  # the relay waits for the client, not for the engine
            await writer.drain()
            self.stalled = False

        self.last = first
        try:
            sink(first)
            if writer.flush():
                await drain()
            await response.splice(sink, writer.flush, drain)
        except httpx.HTTPError as exc:
            if deadlines is not None:
                deadlines.disarm()
            held = self._take_held()
            if held:
                self.last = held
                await send({"type": "http.response.body", "body": held, "more_body": True})
            if not stream_format.finished(self.last):
                failure = self._failed(exc, engine, Stage.STREAM)
                record.error = failure.error.message
                log.warning("request %s: %s", record.request_id, failure.error.message)
                await send(
                    {
                        "type": "http.response.body",
                        "body": stream_format.error_event(failure.error, self.last),
                        "more_body": True,
                    }
                )
        except BaseException:  # the client left (often right after [DONE]) or a deadline: the usage seen still counts
            # (a UsageScanner parses the usage it kept only in finish; HiddenUsage has it as it goes)
            record.usage = scanner.finish() if hidden is None else scanner.usage
            raise
        # asyncio.CancelledError (a deadline) passes: its error event follows self.last (see run)
        if deadlines is not None:
            deadlines.disarm()
        record.usage = scanner.finish()
        await send({"type": "http.response.body", "body": self._take_held(), "more_body": False})

    def _first_token(self, now: float) -> None:
        record = self.record
        record.first_token_at = record.last_token_at = now
        metrics = self.context.metrics
        metrics.first_token(self.request.model, now - record.arrived)
        metrics.endpoint_first_token(record.endpoint, now - record.arrived)
