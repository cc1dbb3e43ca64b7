"""Sends one streamed chat completion and times every part of its answer.

`ChatClient.stream()` is the only place that talks HTTP for requests. It always asks for
`stream: true` and `stream_options.include_usage`, parses the SSE itself (`loadtest.sse`),
times every network read by its arrival, and turns every way of failing into one error kind of
`loadtest.records` (translated in one place, `_classify`).

The HTTP machinery is `loadtest.transport.HTTPClient` (on `http1`, asyncio + httptools, chunks
stamped in the socket's read callback), chosen by measurement (`loadtest.selfcheck`); an
`httpx.AsyncClient` still works (`--http-client httpx`), read through a small adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from loadtest import records, transport
from loadtest.chunks import ChunkKind, error_message, interpret
from loadtest.records import RequestRecord
from loadtest.sse import SSEDecoder, SSEProtocolError

MAX_ERROR_BODY = 64 * 1024
DRAIN_S = 1.0  # after [DONE], how long the end of the body may take before the connection goes


def normalize_base_url(url: str) -> str:
    """The server's base URL without a trailing `/` or `/v1`: `--url` accepts both forms."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def make_http_client(*, max_connections: int | None, timeout_s: float) -> httpx.AsyncClient:
    """An httpx client sized for LLM streams: explicit limits, no 5 s read timeout."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=min(10.0, timeout_s), read=timeout_s, write=timeout_s, pool=timeout_s),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=False,
    )


HTTP_CLIENTS = ("raw", "httpx")


def make_transport(kind: str, *, max_connections: int | None, timeout_s: float):
    """The HTTP client for requests: `raw` (loadtest.transport, the default) or `httpx`."""
    if kind == "raw":
        return transport.HTTPClient(max_connections=max_connections, connect_timeout_s=min(10.0, timeout_s))
    if kind == "httpx":
        return make_http_client(max_connections=max_connections, timeout_s=timeout_s)
    raise ValueError(f"unknown HTTP client {kind!r} ({', '.join(HTTP_CLIENTS)})")


class _HttpxResponse:
    """An httpx streamed response read like a `transport.Response` (chunks timed on wake-up)."""

    def __init__(self, response: httpx.Response, clock: Callable[[], float]) -> None:
        self._response = response
        self._clock = clock
        self._raw = response.aiter_raw()
        self.status_code = response.status_code
        self.headers = response.headers

    async def drain(self) -> None:
        """Nothing: httpx closes a connection whose body was not read to the end (as before)."""

    async def next_chunk(self) -> tuple[bytes, float] | None:
        try:
            data = await anext(self._raw)
        except StopAsyncIteration:
            return None
        return data, self._clock()

    async def aclose(self) -> None:
        await self._response.aclose()


class _HttpxPoster:
    """`post()` over an httpx.AsyncClient, the interface of `transport.HTTPClient`."""

    def __init__(self, http: httpx.AsyncClient, clock: Callable[[], float]) -> None:
        self._http = http
        self._clock = clock

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> _HttpxResponse:
        request = self._http.build_request("POST", url, headers=headers, content=body)
        return _HttpxResponse(await self._http.send(request, stream=True), self._clock)


@dataclass
class Answer:
    """What a request produced besides its record: the text (for the next turn's history)."""

    record: RequestRecord
    text: str


class ChatClient:
    """Streams chat completions from one OpenAI-compatible server and records their timings.

    `http` (a `transport.HTTPClient` or an `httpx.AsyncClient`) is owned by the caller (one
    pool per target); `headers` are sent with every request
    (for example `x-trim-mode: strict`); `extra_body` is merged into every request body;
    the response headers named in `record_headers` are kept in the record.
    """

    def __init__(
        self,
        base_url: str,
        *,
        http: transport.HTTPClient | httpx.AsyncClient,
        model: str,
        api_key: str | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        extra_body: dict | None = None,
        record_headers: tuple[str, ...] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.url = self.base_url + "/v1/chat/completions"
        self.model = model
        self._http = _HttpxPoster(http, clock) if isinstance(http, httpx.AsyncClient) else http
        self._timeout_s = timeout_s
        self._extra_body = dict(extra_body or {})
        self._clock = clock
        self._record_headers = tuple(h.lower() for h in record_headers)
        self._headers = {"accept": "text/event-stream", "content-type": "application/json", **(headers or {})}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"

    def body(self, messages: list[dict], max_tokens: int | None) -> dict:
        body = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(self._extra_body)
        return body

    async def stream(
        self,
        record: RequestRecord,
        messages: list[dict],
        *,
        origin: float,
        on_first_token: Callable[[], None] | None = None,
    ) -> Answer:
        """Send `messages`, fill `record` (times relative to `origin` / to the send), return text.

        Never raises for request failures: they end up in `record.error_kind` / `record.error`.
        Cancelling the calling task still cancels (and closes) the request.
        """
        record.prompt_messages = len(messages)
        record.prompt_chars = sum(len(str(m.get("content") or "")) for m in messages)
        headers = {**self._headers, "x-request-id": record.request_id}
        if record.session_id:
            headers["x-correlation-id"] = record.session_id
        payload = json.dumps(self.body(messages, record.max_tokens)).encode()
        state = _StreamState(record=record, on_first_token=on_first_token)
        sent = self._clock()
        record.sent_s = sent - origin
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._exchange(state, headers, payload, sent)
        except Exception as exc:  # every request failure becomes an error kind
            kind, message = _classify(exc, record)
            record.error_kind = record.error_kind or kind
            record.error = record.error or message
        if record.closed_s is None:
            record.closed_s = self._clock() - sent
        text = "".join(state.text_parts)
        record.output_chars = len(text)
        if record.error_kind is None:
            state.finish()
        return Answer(record, text)

    async def _exchange(self, state: _StreamState, headers: dict, payload: bytes, sent: float) -> None:
        record = state.record
        response = await self._http.post(self.url, headers, payload)
        try:
            record.status = response.status_code
            record.response_headers_s = self._clock() - sent
            if self._record_headers:
                record.headers = {
                    name: response.headers[name] for name in self._record_headers if name in response.headers
                }
            if response.status_code != 200:
                body = await _read_bounded(response)
                record.error_kind = records.HTTP
                record.error = f"HTTP {response.status_code}: {_envelope_message(body)}"
                return
            decoder = SSEDecoder()
            while (chunk := await response.next_chunk()) is not None:
                raw, arrived = chunk
                now = arrived - sent
                for event in decoder.feed(raw):
                    if state.apply(event.data, now):
                        if record.done:  # keep the connection for the next request
                            with contextlib.suppress(TimeoutError):
                                async with asyncio.timeout(DRAIN_S):
                                    await response.drain()
                        return
            for event in decoder.close():
                if state.apply(event.data, self._clock() - sent):
                    return
            record.error_kind = records.TRUNCATED
            record.error = "the stream ended without data: [DONE]"
        finally:
            await response.aclose()
            record.closed_s = self._clock() - sent


@dataclass
class _StreamState:
    """Per-stream bookkeeping while chunks arrive; writes the timings into `record`."""

    record: RequestRecord
    on_first_token: Callable[[], None] | None = None
    text_parts: list[str] = field(default_factory=list)
    token_chunks: int = 0
    first_token_s: float | None = None  # first token chunk, with or without text

    def apply(self, data: str, now: float) -> bool:
        """Apply one SSE `data:` payload; True when the stream is over (DONE or error)."""
        record = self.record
        chunk = interpret(data)
        if chunk.kind is ChunkKind.DONE:
            record.done = True
            return True
        if chunk.kind is ChunkKind.ERROR:
            record.error_kind = records.STREAM_ERROR
            record.error = chunk.error
            return True
        if chunk.usage:
            record.prompt_tokens = _int_or_none(chunk.usage.get("prompt_tokens"))
            record.completion_tokens = _int_or_none(chunk.usage.get("completion_tokens"))
            record.tokens_from_usage = record.completion_tokens is not None
            details = chunk.usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                record.cached_tokens = _int_or_none(details.get("cached_tokens"))
        if chunk.kind in (ChunkKind.ROLE, ChunkKind.TOKEN) and record.first_chunk_s is None:
            record.first_chunk_s = now
        if chunk.kind is not ChunkKind.TOKEN:
            return False
        self.token_chunks += 1
        self.text_parts.append(chunk.text)
        record.finish_reason = chunk.finish_reason or record.finish_reason
        if self.first_token_s is None:
            self.first_token_s = now
        if record.ttft_s is None:
            if not chunk.has_text:
                return False
            record.ttft_s = now
            if self.on_first_token is not None:
                self.on_first_token()
        record.chunk_s.append(now)
        record.e2e_s = now
        return False

    def finish(self) -> None:
        """Close a successful record: TTFT fallback, token-count fallback, no-token check."""
        record = self.record
        if self.first_token_s is None:
            record.error_kind = records.NO_TOKENS
            record.error = "the stream completed without a single token chunk"
            return
        if record.ttft_s is None:
            # Tokens came but none carried text (e.g. partial UTF-8 only): time the first one.
            record.ttft_s = record.e2e_s = self.first_token_s
            record.chunk_s = [self.first_token_s]
        if record.completion_tokens is None:
            record.completion_tokens = self.token_chunks
            record.tokens_from_usage = False


async def _read_bounded(response) -> bytes:
    body = b""
    while (chunk := await response.next_chunk()) is not None:
        body += chunk[0]
        if len(body) >= MAX_ERROR_BODY:
            break
    return body[:MAX_ERROR_BODY]


def _envelope_message(body: bytes) -> str:
    try:
        return error_message(json.loads(body))
    except ValueError:
        return body[:300].decode("utf-8", "replace") or "(empty body)"


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) else None


def _classify(exc: BaseException, record: RequestRecord) -> tuple[str, str]:
    """Translate a lower-layer exception into (error kind, message), in one place."""
    message = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return records.TIMEOUT, message
    if isinstance(exc, SSEProtocolError):
        return records.TRUNCATED, message
    if record.status is None:
        return records.CONNECTION, message
    # The status line arrived, then the connection broke: a truncated stream.
    return records.TRUNCATED, message
