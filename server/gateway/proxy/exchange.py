"""The hot path: POST /v1/chat/completions and /v1/completions, forwarded to an engine.

A raw ASGI endpoint (no request/response objects, no per-chunk framework work). For each
request it reads the body (bounded), checks the little it must (`validation`), picks a replica
(`routing`), forwards the body bytes as received, and answers as the engine answers: same
status, same headers (minus hop-by-hop ones), same bytes. Streams are relayed chunk by chunk as
they arrive; per chunk the only extra work is two `bytes.find` calls (first token, usage).

Failure handling, in the order a request meets it:
- connection refused/reset, or a 503, before any byte reached the client: another replica,
  up to `retries.max_attempts`, with doubling backoff (a refusing engine is also marked down);
- no byte from the engine within `timeouts.first_byte` (response headers, and for a stream its
  first chunk; for a non-streaming request that is the whole answer): 504;
- more than `timeouts.idle` between two chunks, or `timeouts.total` overall, once streaming:
  the stream ends with `data: {"error": ...}` and `data: [DONE]`, like an engine failing
  mid-stream does;
- the client leaving, at any point: the upstream response is closed, so vLLM aborts the
  request, within milliseconds.
Deadlines and disconnects cancel the request's task (`_Guard`); `Exchange.attempt` owns the
upstream response and closes it on every path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import httpx

from server.gateway.edge.context import request_id
from server.gateway.errors import (
    BodyTooLarge,
    ClientDisconnected,
    GatewayError,
    NoEngineAvailable,
    UpstreamFailed,
    UpstreamTimeout,
    send_error,
    stream_error_event,
)
from server.gateway.engines.routing import affinity_key
from server.gateway.settings import GatewaySettings
from server.gateway.proxy.sse import UsageScanner, ends_with_done, has_token, usage_from_body
from server.gateway.proxy.transport import Upstream, UpstreamResponse
from server.gateway.engines.pool import Engine, ModelPool, Upstreams
from server.gateway.edge.endpoints import BY_NAME
from server.gateway.edge.requests import parse_request
from typing import Literal
Endpoint = Literal["chat", "completions"]

log = logging.getLogger("gateway.proxy")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Response headers that describe the engine's connection, not the answer.
_DROPPED_RESPONSE_HEADERS = frozenset({
    b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server",
    b"proxy-authenticate", b"proxy-connection", b"te", b"trailer", b"upgrade", b"x-request-id",
})
# Errors before the first byte that say "this engine, not this request": try another replica.
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
              httpx.WriteError)
UNKNOWN_MODEL = "_unknown"  # the metrics label of requests refused before their model was known
CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection"; logs and metrics only


class _Guard:
    """Deadlines and the client's disconnect for one request: either one cancels its task.

    It fires at most once; `reason` says why. Per streamed chunk the proxy only stores the time
    (`last`); the idle timer re-arms itself lazily, at most once per idle period.
    """

    __slots__ = ("task", "reason", "last", "_loop", "_handle", "_armed", "_streaming", "_first_byte_at",
                 "_total_at", "_idle", "_watcher")

    def __init__(self, task: asyncio.Task, arrived: float, first_byte: float, idle: float, total: float,
                 receive: Receive) -> None:
        self.task = task
        self.reason: str | None = None
        self._loop = asyncio.get_running_loop()
        self._armed = True
        self._streaming = False
        now = perf_counter()
        self.last = now
        self._first_byte_at = now + first_byte
        self._total_at = arrived + total
        self._idle = idle
        self._handle: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task | None = None
        # The timer and the disconnect watcher start on the loop's next turn: by then the request
        # has gone out to the engine, so setting them up costs nothing on the way there.
        self._loop.call_soon(self._start, receive)

    def _start(self, receive: Receive) -> None:
        if not self._armed:
            return
        if not self._streaming:
            self._arm(min(self._first_byte_at, self._total_at))
        self._watcher = self._loop.create_task(_watch_disconnect(receive, self))

    def _arm(self, at: float) -> None:
        self._handle = self._loop.call_later(max(0.0, at - perf_counter()), self._check)

    def _check(self) -> None:
        if not self._armed:
            return
        now = perf_counter()
        if now >= self._total_at:
            self.fire("total")
        elif not self._streaming:
            if now >= self._first_byte_at:
                self.fire("first_byte")
            else:
                self._arm(min(self._first_byte_at, self._total_at))
        else:
            idle_at = self.last + self._idle
            if now >= idle_at:
                self.fire("idle")
            else:
                self._arm(min(idle_at, self._total_at))

    def streaming(self, now: float) -> None:
        """The first chunk went out: from now on the idle deadline applies."""
        self._streaming = True
        self.last = now
        if self._handle is not None:
            self._handle.cancel()
        self._arm(min(now + self._idle, self._total_at))

    def fire(self, reason: str) -> None:
        if not self._armed:
            return
        self.disarm()
        self.reason = reason
        self.task.cancel()

    def disarm(self) -> None:
        """The upstream answer is complete: nothing may cancel the request any more."""
        self._armed = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None  # the handle refers back to us: no cycle for the collector

    def close(self) -> None:
        self.disarm()
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None  # likewise (its cancelled coroutine's frame refers to us)


async def _watch_disconnect(receive: Receive, guard: _Guard) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            guard.fire("disconnect")
            return


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    """The whole request body; 413 past `limit` (announced or counted), ClientDisconnected if the client left."""
    for name, value in headers:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise BodyTooLarge(limit)
            break
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Retry(Exception):
    """This attempt failed before anything reached the client; another replica may do better."""

    def __init__(self, error: GatewayError, response: tuple[int, list, bytes] | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.response = response  # an engine's 503, passed through if no replica does better


class Proxy:
    """Forwards the two generation endpoints to engines; one instance per app."""

    def __init__(self, *, settings: GatewaySettings, upstreams: Upstreams, upstream: Upstream,
                 metrics: Any, log_request: Callable[..., None] | None = None) -> None:
        self.settings = settings
        self.upstreams = upstreams
        # `post()` of UpstreamTransport (or of any httpx client through ClientUpstream): no
        # httpx.Request/Response objects on the hot path, ~100 us less per request than a client.
        self.upstream = upstream
        self.metrics = metrics
        self.log_request = log_request
        t = settings.timeouts
        # Only the connect limit is the client's; first byte, idle and total are our own deadlines
        # (_Guard), so socket reads carry no timer of their own.
        self.connect_timeout = t.connect
        self.forward_auth = False  # set by create_app when the gateway checks keys itself
        self._targets: dict[tuple[str, Endpoint], Any] = {}

    def target(self, engine: Engine, kind: Endpoint) -> Any:
        """The engine's endpoint, parsed once (parsing a URL costs more than the rest of a request's set-up)."""
        key = (engine.url, kind)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = self.upstream.target(engine.url + PATHS[kind])
        return target

    def endpoint(self, kind: Endpoint) -> ProxyEndpoint:
        return ProxyEndpoint(self, kind)


class ProxyEndpoint:
    """The ASGI app of one generation endpoint (a class, so Starlette routes to it as raw ASGI)."""

    __slots__ = ("proxy", "kind")

    def __init__(self, proxy: Proxy, kind: Endpoint) -> None:
        self.proxy = proxy
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await Exchange(self.proxy, self.kind, scope, send).run(receive)


class Exchange:
    """One client request and its answer, from the first body byte to the last log line."""

    __slots__ = ("proxy", "kind", "scope", "send", "arrived", "request_id", "model", "engine", "status",
                 "stream", "first_token_at", "last_token_at", "usage", "error", "started", "guard")

    def __init__(self, proxy: Proxy, kind: Endpoint, scope: Scope, send: Send) -> None:
        self.proxy = proxy
        self.kind = kind
        self.scope = scope
        self.send = send
        self.arrived = perf_counter()
        self.request_id = request_id(scope)
        self.model: str | None = None  # a known model, once validated
        self.engine: Engine | None = None
        self.status = 0
        self.stream = False
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.started = False  # response headers went to the client
        self.guard: _Guard | None = None

    # -- the request, start to end ---------------------------------------------------------------

    async def run(self, receive: Receive) -> None:
        proxy = self.proxy
        try:
            raw = await read_body(receive, self.scope["headers"], proxy.settings.limits.max_body_bytes)
            request = parse_request(raw, BY_NAME[self.kind])
            pool = proxy.upstreams.get(request.model)
            self.model = request.model
            self.stream = request.stream
            proxy.metrics.request_started(self.model)
            await self._forward_guarded(receive, pool, request.body, raw)
        except ClientDisconnected:
            self.status, self.error = CLIENT_CLOSED, "client disconnected"
        except GatewayError as exc:
            self.error = exc.message
            if self.started:  # cannot happen by construction; say so loudly rather than hang
                log.error("request %s: %s after the response started", self.request_id, exc.message)
            else:
                self.status = exc.status
                await send_error(self.send, exc)
        finally:
            self._finish()

    async def _forward_guarded(self, receive: Receive, pool: ModelPool, body: dict, raw: bytes) -> None:
        t = self.proxy.settings.timeouts
        task = asyncio.current_task()
        assert task is not None
        guard = self.guard = _Guard(task, self.arrived, t.first_byte, t.idle, t.total, receive)
        try:
            await self._forward(pool, body, raw)
        except asyncio.CancelledError:
            if guard.reason is None:  # not ours: the server is shutting down
                await self._end_stream_on_shutdown()
                raise
            task.uncancel()
            await self._on_guard(guard.reason)
        finally:
            guard.close()

    async def _forward(self, pool: ModelPool, body: dict, raw: bytes) -> None:
        """Try replicas until one answers; failures before the first byte move to the next one."""
        settings = self.proxy.settings
        routing = settings.routing
        key = affinity_key(body, session=self._header(routing.session_header.lower().encode()),
                           prefix_affinity=routing.prefix_affinity, prefix_chars=routing.prefix_chars,
                           prefix_min_chars=routing.prefix_min_chars)
        tried: list[Engine] = []
        failure: _Retry | None = None
        for attempt in range(settings.retries.max_attempts):
            engine = pool.acquire(routing, key=key, exclude=tried)
            if engine is None:
                break
            tried.append(engine)
            self.engine = engine
            try:
                await self.attempt(engine, raw)
                return
            except _Retry as retry:
                failure = retry
                log.warning("request %s: engine %s failed before the first byte (%s)%s", self.request_id,
                            engine.id, retry.error.message,
                            "; retrying" if attempt + 1 < settings.retries.max_attempts else "")
            finally:
                pool.release(engine)
            more = attempt + 1 < settings.retries.max_attempts
            if more and settings.retries.backoff and any(e.healthy and e not in tried for e in pool.engines):
                await asyncio.sleep(settings.retries.backoff * 2**attempt)
        if failure is None:
            raise NoEngineAvailable(f"No healthy engine for model `{pool.name}` right now; try again shortly.")
        if failure.response is not None:  # the engine's own 503: the client sees it as the engine sent it
            status, headers, content = failure.response
            self.error = failure.error.message
            await self._respond(status, headers, content)
            return
        raise failure.error

    # -- one engine -------------------------------------------------------------------------------

    def _upstream_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json"), (b"x-request-id", self.request_id.encode()),
                   (b"accept-encoding", b"identity")]
        accept = self._header(b"accept")
        headers.append((b"accept", accept.encode() if accept else b"*/*"))
        if self.proxy.forward_auth:
            auth = self._header(b"authorization")
            if auth:
                headers.append((b"authorization", auth.encode("latin-1")))
        return headers

    async def attempt(self, engine: Engine, raw: bytes) -> None:
        """Send the request to `engine` and relay its answer. Owns the upstream response: closed on every path."""
        proxy = self.proxy
        response: UpstreamResponse | None = None
        try:
            try:
                response = await proxy.upstream.post(proxy.target(engine, self.kind), self._upstream_headers(), raw,
                                                     connect_timeout=proxy.connect_timeout)
            except httpx.ConnectTimeout as exc:
                engine.mark_down(f"ConnectTimeout: {exc}")
                raise _Retry(UpstreamTimeout(
                    f"Engine {engine.id} of model `{engine.model}` did not accept a connection within "
                    f"{proxy.connect_timeout:g} s.")) from None
            except httpx.ConnectError as exc:
                engine.mark_down(f"ConnectError: {exc}")
                raise _Retry(NoEngineAvailable(
                    f"Engine {engine.id} of model `{engine.model}` is unreachable ({exc}).")) from None
            except _RETRYABLE as exc:
                raise _Retry(UpstreamFailed(f"Engine {engine.id} closed the connection before answering "
                                            f"({type(exc).__name__}).")) from None
            except httpx.TimeoutException as exc:
                raise UpstreamTimeout(f"Engine {engine.id} did not answer in time ({type(exc).__name__}).") from None
            except httpx.HTTPError as exc:
                raise UpstreamFailed(f"Engine {engine.id} failed: {type(exc).__name__}.") from None
            if response.status_code == 503:
                content = await self._read_whole(response, engine)
                raise _Retry(NoEngineAvailable(f"Engine {engine.id} answered 503."),
                             (503, response.headers, content))
            if self.stream and response.status_code == 200:
                await self._relay_stream(response, engine)
            else:
                content = await self._read_whole(response, engine)
                if self.guard is not None:
                    self.guard.disarm()
                if response.status_code == 200:
                    self.usage = usage_from_body(content)
                await self._respond(response.status_code, response.headers, content)
        finally:
            if response is not None:
                await response.aclose()

    async def _read_whole(self, response: UpstreamResponse, engine: Engine) -> bytes:
        try:
            return await response.aread()
        except _RETRYABLE as exc:
            raise _Retry(UpstreamFailed(f"Engine {engine.id} broke off its answer ({type(exc).__name__}).")) from None
        except httpx.HTTPError as exc:
            raise UpstreamFailed(f"Engine {engine.id} broke off its answer ({type(exc).__name__}).") from None

    async def _relay_stream(self, response: UpstreamResponse, engine: Engine) -> None:
        """Relay an SSE stream chunk by chunk; a failure after the first chunk ends it with an error event."""
        send = self.send
        read_chunk = response.read_chunk  # b"" at the end; no async-generator layer per chunk
        try:
            first = await read_chunk()
        except _RETRYABLE as exc:
            raise _Retry(UpstreamFailed(f"Engine {engine.id} broke off before its first chunk "
                                        f"({type(exc).__name__}).")) from None
        except httpx.HTTPError as exc:
            raise UpstreamFailed(f"Engine {engine.id} failed before its first chunk ({type(exc).__name__}).") from None
        await self._start(response.status_code, response.headers)
        now = perf_counter()
        guard = self.guard
        if guard is not None:
            guard.streaming(now)
        metrics = self.proxy.metrics
        model = self.model
        scanner = UsageScanner()
        last = first
        if has_token(first):
            self._first_token(now)
        scanner.feed(first)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            while chunk := await read_chunk():
                now = perf_counter()
                if guard is not None:
                    guard.last = now
                if has_token(chunk):
                    if self.first_token_at:
                        metrics.inter_token(model, now - self.last_token_at)
                        self.last_token_at = now
                    else:
                        self._first_token(now)
                scanner.feed(chunk)
                last = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            if guard is not None:
                guard.disarm()
            if not ends_with_done(last):
                failure = UpstreamFailed(f"Engine {engine.id} failed mid-stream ({type(exc).__name__}).")
                self.error = failure.message
                log.warning("request %s: %s", self.request_id, failure.message)
                await send({"type": "http.response.body", "body": stream_error_event(failure), "more_body": True})
        if guard is not None:
            guard.disarm()
        self.usage = scanner.finish()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _first_token(self, now: float) -> None:
        self.first_token_at = self.last_token_at = now
        self.proxy.metrics.first_token(self.model, now - self.arrived)

    # -- answering the client ---------------------------------------------------------------------

    async def _start(self, status: int, upstream_headers: list[tuple[bytes, bytes]],
                     content_length: int | None = None) -> None:
        headers = [(k, v) for k, v in upstream_headers if k.lower() not in _DROPPED_RESPONSE_HEADERS]
        if content_length is not None:
            headers.append((b"content-length", str(content_length).encode()))
        self.status = status
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def _respond(self, status: int, upstream_headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        await self._start(status, upstream_headers, len(content))
        await self.send({"type": "http.response.body", "body": content, "more_body": False})

    async def _on_guard(self, reason: str) -> None:
        """A deadline passed or the client left (the upstream response is closed already)."""
        t = self.proxy.settings.timeouts
        if reason == "disconnect":
            self.status, self.error = CLIENT_CLOSED, "client disconnected"
            return
        limit = {"first_byte": ("first byte", t.first_byte), "idle": ("idle", t.idle),
                 "total": ("total", t.total)}[reason]
        where = f" {self.engine.id}" if self.engine else ""
        exc = UpstreamTimeout(f"Engine{where} exceeded the gateway's {limit[0]} timeout of {limit[1]:g} s.")
        self.error = exc.message
        log.warning("request %s: %s", self.request_id, exc.message)
        if not self.started:
            self.status = exc.status
            await send_error(self.send, exc)
        else:
            await self.send({"type": "http.response.body", "body": stream_error_event(exc), "more_body": False})

    async def _end_stream_on_shutdown(self) -> None:
        """The server's grace period is over: end a started stream properly instead of cutting it."""
        if self.started and self.stream:
            exc = UpstreamFailed("The gateway is shutting down; the stream was cut at its grace deadline.",
                                 code="gateway_shutdown")
            self.error = exc.message
            try:
                await self.send({"type": "http.response.body", "body": stream_error_event(exc), "more_body": False})
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        else:
            self.status, self.error = self.status or 503, "gateway shutting down"

    def _header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value.decode("latin-1")
        return None

    # -- bookkeeping ------------------------------------------------------------------------------

    def _finish(self) -> None:
        duration = perf_counter() - self.arrived
        usage = self.usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        completion_tokens = usage.get("completion_tokens")
        metrics = self.proxy.metrics
        if self.model is not None:
            if isinstance(prompt_tokens, int) or isinstance(completion_tokens, int):
                metrics.usage(self.model, prompt_tokens or 0, completion_tokens or 0)
            metrics.request_finished(self.model, self.status, duration, self.stream)
        else:  # refused before a served model was known: counted, under one label
            metrics.request_started(UNKNOWN_MODEL)
            metrics.request_finished(UNKNOWN_MODEL, self.status, duration, self.stream)
        log_request = self.proxy.log_request
        if log_request is not None:
            trim = self.scope.get("state", {}).get("trimming")
            log_request(
                request_id=self.request_id, model=self.model, engine=self.engine.id if self.engine else None,
                status=self.status, stream=self.stream,
                ttft_s=self.first_token_at - self.arrived if self.first_token_at else None,
                duration_s=duration, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                trimmed_messages=getattr(trim, "dropped_messages", None),
                trimmed_tokens=getattr(trim, "dropped_tokens", None), error=self.error,
            )
