"""A stand-in for a vLLM 0.32 OpenAI server: real HTTP, vLLM's JSON shapes, exact timing, faults.

Tests and benchmarks run it where a real engine would be too slow, too random or impossible to
break on purpose. It answers like vLLM (`chat.completion`, `chat.completion.chunk`,
`text_completion`, the OpenAI error envelope, `/tokenize`, `/metrics` with vLLM's names) and
generates `tokens` tokens: the first `ttft_ms` after the request arrived, then one every `itl_ms`.

Token counting is deterministic so that callers can predict it (see `count_chat_tokens`):
a chat message costs 4 + its whitespace-separated words, the generation prompt 3, and a plain
prompt its words. Every generated token is one word, so a reply of n tokens has n words.

Runtime control (JSON):
- `POST /_standin/faults` sets faults (replacing the previous set; `{}` resets):
  `health_status` (status of /health), `status` (answer generation requests with that status and
  an OpenAI error envelope), `die_after_chunks` (close the TCP connection abruptly after that many
  SSE events; non-streaming: after that much generation time, without an answer),
  `first_byte_delay_s` (before the response headers), `stall_after_chunks` + `stall_s` (pause a
  stream), `tokenize_status`, `kv_cache_usage_perc`, `ttft_ms`, `itl_ms`, `tokens`, `hold` (keep
  each accepted generation request in flight, before its first byte, until `POST /_standin/release`),
  and `times` (the faults apply to that many generation requests, then reset themselves).
- `POST /_standin/release` lets every held request go on (its timing starts then) and clears `hold`.
- A request body may carry `"standin": {...}` with the per-request keys above (`ttft_ms`,
  `itl_ms`, `tokens`, `die_after_chunks`, `first_byte_delay_s`, `stall_after_chunks`, `stall_s`,
  `status`); they win over the faults for that request only.
- `GET /_standin/timings`: engine-side timings of recent generation requests, by request id
  (`x-request-id`, else a generated one), on the stand-in's `time.perf_counter()` clock:
  `arrived` (the handler started), `first_token` and `last_token` (just after the first / last
  token event was handed to the server; streams only), `ended`, `tokens` (token events sent),
  and `ttft_s` = `first_token - arrived`. The last `TIMINGS_KEPT` requests are kept;
  `DELETE /_standin/timings` forgets them. Load testers join these with their own timings to
  measure the time they add themselves.
- `StandinConfig(prompt_tokens_details=True)` (`--prompt-tokens-details`) adds
  `usage.prompt_tokens_details.cached_tokens` (the prompt tokens found in the stand-in's prefix
  cache), as vLLM does with `--enable-prompt-tokens-details`; off by default, like vLLM.
- `GET /_standin/stats`: `running`, `started`, `finished`, `aborted` (the client left before the
  response finished; seen at once through `http.disconnect`), `rejected` (answered with an error),
  `died` (dropped by `die_after_chunks`), `held` (waiting for a release), `peak_running`,
  `tokenize_calls`, `requests` (per path), `last_request` (`path`, `headers`, `body` of the last
  generation request) and `last_tokenize`. `DELETE /_standin/stats` zeroes them.

Differences from vLLM 0.32 on purpose: a chat request whose prompt plus `max_tokens` exceeds
`max_model_len` gets 400 (old vLLM behaviour; vLLM 0.32 shortens the answer instead) unless
`strict_context=False`; `x-request-id` is echoed in the response headers (vLLM does that with
`--enable-request-id-headers`).

Run it: `python -m tests.standin --port 8200 [--ttft-ms 20] [--itl-ms 10] [--tokens 32]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SYSTEM_FINGERPRINT = "vllm-0.32.0-standin"
VOCABULARY = (" The", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " again")
TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
PREFIX_BLOCK_WORDS = 16  # "block size" of the stand-in's prefix cache, in tokens (= words)
PREFIX_CACHE_BLOCKS = 50_000
TIMINGS_KEPT = 100_000  # engine-side timings of this many recent requests are kept

FAULT_KEYS = {
    "health_status": int,
    "status": int,
    "die_after_chunks": int,
    "first_byte_delay_s": float,
    "stall_after_chunks": int,
    "stall_s": float,
    "tokenize_status": int,
    "kv_cache_usage_perc": float,
    "ttft_ms": float,
    "itl_ms": float,
    "tokens": int,
    "hold": bool,
    "times": int,
}
REQUEST_KEYS = {
    "status", "die_after_chunks", "first_byte_delay_s", "stall_after_chunks", "stall_s",
    "ttft_ms", "itl_ms", "tokens",
}  # fmt: skip

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON_HEADERS = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"


@dataclasses.dataclass
class StandinConfig:
    """What the stand-in engine serves and how fast it generates."""

    model: str = "standin"
    ttft_ms: float = 20.0
    itl_ms: float = 10.0
    tokens: int = 32  # tokens generated when max_tokens does not stop earlier
    max_model_len: int = 4096
    strict_context: bool = True  # 400 when prompt + max_tokens > max_model_len
    kv_cache_tokens: int = 65536  # capacity behind vllm:kv_cache_usage_perc
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM's flag


def _words(text: Any) -> int:
    if isinstance(text, str):
        return len(text.split())
    if isinstance(text, list):  # content parts
        return sum(_words(part.get("text", "")) for part in text if isinstance(part, dict))
    return 0


def count_message_tokens(message: dict) -> int:
    """Tokens of one chat message: 4 + words of its content, name and tool calls."""
    count = TOKENS_PER_MESSAGE + _words(message.get("content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {} if isinstance(call, dict) else {}
        count += 1 + _words(function.get("name", "")) + _words(function.get("arguments", ""))
    return count


def count_chat_tokens(messages: list[dict], add_generation_prompt: bool = True) -> int:
    """The stand-in's prompt token count of a chat request (what /tokenize and usage report)."""
    total = sum(count_message_tokens(message) for message in messages)
    return total + (GENERATION_PROMPT_TOKENS if add_generation_prompt else 0)


def count_prompt_tokens(prompt: Any) -> int:
    """Tokens of a /v1/completions or /tokenize `prompt`: words of a string, or token ids."""
    if isinstance(prompt, str):
        return _words(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(_words(item) for item in prompt)
    if isinstance(prompt, list):
        return len(prompt)
    return 0


def _prompt_words(body: dict) -> list[str]:
    if "messages" in body:
        words: list[str] = []
        for message in body["messages"]:
            words.append(f"<{message.get('role')}>")
            content = message.get("content")
            words.extend(content.split() if isinstance(content, str) else [json.dumps(content)])
        return words
    prompt = body.get("prompt")
    return prompt.split() if isinstance(prompt, str) else [json.dumps(prompt)]


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class _Died(Exception):
    """A `die_after_chunks` fault fired: the connection is to be dropped mid-response."""


@dataclasses.dataclass
class _Generation:
    """One accepted generation request, everything computed before the first byte is sent."""

    chat: bool
    stream: bool
    include_usage: bool
    request_id: str
    prompt_tokens: int
    n_tokens: int
    finish_reason: str
    ttft_s: float
    itl_s: float
    die_after_chunks: int | None
    first_byte_delay_s: float
    stall_after_chunks: int | None
    stall_s: float
    headers: list[tuple[bytes, bytes]]
    hold: bool = False  # wait for POST /_standin/release before answering
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (when reported)


class _ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


async def _sleep_until(deadline: float) -> None:
    """Sleep until `deadline` on `time.perf_counter()`'s clock, never waking before it: the event
    loop's clock is read once per loop turn and its timers have a 1 ms resolution, so one sleep on
    a busy machine can end a little early (a token would then beat its schedule)."""
    while (remaining := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(remaining)


class Standin:
    """The ASGI app. One instance is one engine; its counters and faults live on it."""

    def __init__(self, config: StandinConfig):
        self.config = config
        self.faults: dict[str, Any] = {}
        self._reset_stats()
        self._prefix_blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._kv_in_use = 0
        self._release: asyncio.Event | None = None  # what held requests wait for (made on the server's loop)
        self.timings: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._created = int(time.time())
        self._routes: dict[tuple[str, str], Callable] = {
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/tokenize"): self._tokenize,
            ("GET", "/_standin/stats"): self._get_stats,
            ("DELETE", "/_standin/stats"): self._delete_stats,
            ("GET", "/_standin/faults"): self._get_faults,
            ("POST", "/_standin/faults"): self._set_faults,
            ("POST", "/_standin/release"): self._release_held,
            ("GET", "/_standin/timings"): self._get_timings,
            ("DELETE", "/_standin/timings"): self._delete_timings,
        }

    def _reset_stats(self) -> None:
        self.running = 0
        self.peak_running = 0
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.rejected = 0
        self.died = 0
        self.held = 0
        self.tokenize_calls = 0
        self.requests: collections.Counter[str] = collections.Counter()
        self.last_request: dict | None = None
        self.last_tokenize: dict | None = None

    def stats(self) -> dict:
        return {
            "running": self.running,
            "peak_running": self.peak_running,
            "started": self.started,
            "finished": self.finished,
            "aborted": self.aborted,
            "rejected": self.rejected,
            "died": self.died,
            "held": self.held,
            "tokenize_calls": self.tokenize_calls,
            "requests": dict(self.requests),
            "last_request": self.last_request,
            "last_tokenize": self.last_tokenize,
        }

    # ---- ASGI plumbing -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        handler = self._routes.get((scope["method"], path))
        if handler is None:
            known = any(route_path == path for _, route_path in self._routes)
            status, detail = (405, "Method Not Allowed") if known else (404, "Not Found")
            await _send_json(send, status, {"detail": detail})
            return
        try:
            await handler(scope, receive, send)
        except _ClientGone:
            return  # left before its request body arrived: nothing to answer

    # ---- small endpoints -----------------------------------------------------------------

    async def _health(self, scope, receive, send) -> None:
        status = self.faults.get("health_status", 200)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _version(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"version": "0.32.0"})

    async def _models(self, scope, receive, send) -> None:
        model = self.config.model
        card = {
            "id": model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": self.config.max_model_len,
            "permission": [{
                "id": "modelperm-standin", "object": "model_permission", "created": self._created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }  # fmt: skip
        await _send_json(send, 200, {"object": "list", "data": [card]})

    async def _metrics(self, scope, receive, send) -> None:
        labels = f'engine="0",model_name="{self.config.model}"'
        usage = self.faults.get("kv_cache_usage_perc")
        if usage is None:
            usage = min(1.0, self._kv_in_use / self.config.kv_cache_tokens)
        block = PREFIX_BLOCK_WORDS
        lines = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
             f"{{{labels}}} {float(self.running)}"),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             f"{{{labels}}} 0.0"),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             f"{{{labels}}} {float(usage)}"),
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.",
             f"{{{labels}}} {float(self.prefix_queries)}"),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
             f"{{{labels}}} {float(self.prefix_hits)}"),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             f"{{{labels}}} 0.0"),
            ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
             f'{{block_size="{block}",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
             f'kv_cache_size_tokens="{self.config.kv_cache_tokens}",'
             f'num_gpu_blocks="{self.config.kv_cache_tokens // block}"}} 1.0'),
        ]  # fmt: skip
        text = "".join(
            f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{sample}\n" for name, kind, help_, sample in lines
        )
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": text.encode()})

    async def _get_stats(self, scope, receive, send) -> None:
        await _send_json(send, 200, self.stats())

    async def _delete_stats(self, scope, receive, send) -> None:
        self._reset_stats()
        await _send_json(send, 200, self.stats())

    async def _get_timings(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"clock": "perf_counter", "requests": self.timings})

    async def _delete_timings(self, scope, receive, send) -> None:
        self.timings.clear()
        await _send_json(send, 200, {"clock": "perf_counter", "requests": {}})

    def _timing(self, request_id: str, arrived: float) -> dict:
        """A fresh engine-side timing entry for one request (the oldest ones are dropped)."""
        timing = {
            "arrived": arrived,
            "first_token": None,
            "last_token": None,
            "ended": None,
            "tokens": 0,
            "ttft_s": None,
        }
        self.timings[request_id] = timing
        self.timings.move_to_end(request_id)
        while len(self.timings) > TIMINGS_KEPT:
            self.timings.popitem(last=False)
        return timing

    async def _get_faults(self, scope, receive, send) -> None:
        await _send_json(send, 200, self.faults)

    async def _set_faults(self, scope, receive, send) -> None:
        try:
            body = json.loads(await _read_body(receive) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("faults must be a JSON object")
            unknown = sorted(set(body) - set(FAULT_KEYS))
            if unknown:
                raise ValueError(f"unknown fault keys {unknown}; known: {sorted(FAULT_KEYS)}")
            self.faults = {key: FAULT_KEYS[key](value) for key, value in body.items() if value is not None}
        except (ValueError, TypeError) as exc:
            await _send_error(send, _ApiError(400, str(exc)))
            return
        await _send_json(send, 200, self.faults)

    async def _release_held(self, scope, receive, send) -> None:
        await _read_body(receive)
        released = self.held
        self.faults = {key: value for key, value in self.faults.items() if key != "hold"}
        if self._release is not None:
            self._release.set()
            self._release = None
        await _send_json(send, 200, {"released": released})

    async def _hold(self) -> None:
        if self._release is None:
            self._release = asyncio.Event()
        release = self._release
        self.held += 1
        try:
            await release.wait()
        finally:
            self.held -= 1

    async def _tokenize(self, scope, receive, send) -> None:
        self.tokenize_calls += 1
        try:
            body = _parse_json(await _read_body(receive))
            self.last_tokenize = {"path": scope["path"], "headers": _headers(scope), "body": body}
            if "tokenize_status" in self.faults:
                raise _ApiError(self.faults["tokenize_status"], "stand-in fault", "ServiceUnavailableError")
            self._check_model(body)
            if "messages" in body:
                _check_messages(body["messages"])
                count = count_chat_tokens(body["messages"], body.get("add_generation_prompt", True))
            elif "prompt" in body:
                count = count_prompt_tokens(body["prompt"])
            else:
                raise _ApiError(400, "Either `prompt` or `messages` is required.", "Bad Request", "body")
        except _ApiError as exc:
            await _send_error(send, exc)
            return
        result = {
            "count": count, "max_model_len": self.config.max_model_len,
            "tokens": list(range(count)), "token_strs": None,
        }  # fmt: skip
        await _send_json(send, 200, result)

    # ---- generation ----------------------------------------------------------------------

    async def _chat(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, chat=False)

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise _ApiError(
                404, f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                "NotFoundError", "model",
            )  # fmt: skip

    def _plan(self, scope: Scope, body: dict, chat: bool, faults: dict) -> _Generation:
        """Validate a generation request like vLLM and work out what to send, or raise _ApiError."""
        self._check_model(body)
        config = self.config
        if chat:
            if "messages" not in body:
                raise _validation_error("missing", "body.messages", "Field required")
            _check_messages(body["messages"])
            prompt_tokens = count_chat_tokens(body["messages"], body.get("add_generation_prompt", True))
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            if "prompt" not in body:
                raise _validation_error("missing", "body.prompt", "Field required")
            prompt_tokens = count_prompt_tokens(body["prompt"])
            max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
            raise _validation_error("int_type", "body.max_tokens", "Input should be a valid integer")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _validation_error("bool_type", "body.stream", "Input should be a valid boolean")
        if max_tokens is not None and max_tokens < 1:
            raise _ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if max_tokens is not None and max_tokens > config.max_model_len:
            raise _ApiError(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={config.max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        if prompt_tokens >= config.max_model_len:
            shown = min(prompt_tokens, config.max_model_len + 1)
            raise _ApiError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. However, your "
                f"prompt contains at least {shown} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={shown})",
                param="input_tokens",
            )
        if config.strict_context and max_tokens is not None and prompt_tokens + max_tokens > config.max_model_len:
            raise _ApiError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
                param="input_tokens",
            )
        extension = body.get("standin") or {}
        if not isinstance(extension, dict) or set(extension) - REQUEST_KEYS:
            raise _ApiError(400, f"`standin` takes an object with keys {sorted(REQUEST_KEYS)}", param="standin")
        knobs = {**faults, **extension}
        if "status" in knobs:
            raise _ApiError(knobs["status"], "stand-in fault: answering with a fixed status", "StandinFault")
        natural = int(knobs.get("tokens", config.tokens))
        n_tokens = natural if max_tokens is None else min(natural, max_tokens)
        finish_reason = "length" if max_tokens is not None and max_tokens <= natural else "stop"
        stream_options = body.get("stream_options") or {}
        request_id = _header(scope, b"x-request-id")
        headers = [(b"x-request-id", request_id.encode())] if request_id else []
        return _Generation(
            chat=chat, stream=stream, include_usage=bool(stream and stream_options.get("include_usage")),
            request_id=request_id or uuid.uuid4().hex[:16], prompt_tokens=prompt_tokens,
            n_tokens=n_tokens, finish_reason=finish_reason,
            ttft_s=float(knobs.get("ttft_ms", config.ttft_ms)) / 1000,
            itl_s=float(knobs.get("itl_ms", config.itl_ms)) / 1000,
            die_after_chunks=knobs.get("die_after_chunks"),
            first_byte_delay_s=float(knobs.get("first_byte_delay_s", 0.0)),
            stall_after_chunks=knobs.get("stall_after_chunks"), stall_s=float(knobs.get("stall_s", 0.0)),
            headers=headers, hold=bool(knobs.get("hold", False)),
        )  # fmt: skip

    def _consume_times(self) -> None:
        if "times" in self.faults:
            remaining = self.faults["times"] - 1
            self.faults = {**self.faults, "times": remaining} if remaining > 0 else {}

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        arrived = time.perf_counter()
        self.requests[scope["path"]] += 1
        raw = await _read_body(receive)
        try:
            body = _parse_json(raw)
            self.last_request = {"path": scope["path"], "headers": _headers(scope), "body": body}
            faults = self.faults
            if faults:
                self._consume_times()
            plan = self._plan(scope, body, chat, faults)
        except _ApiError as exc:
            self.rejected += 1
            await _send_error(send, exc, _request_id_headers(scope))
            return
        self.started += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        kv = plan.prompt_tokens + plan.n_tokens
        self._kv_in_use += kv
        cached = self._count_prefix(body)
        if self.config.prompt_tokens_details:
            plan.cached_tokens = min(cached, plan.prompt_tokens)
        timing = self._timing(plan.request_id, arrived)
        main = asyncio.current_task()
        state = {"done": False, "gone": False}
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, main, state))
        try:
            begun = arrived
            if plan.hold:
                await self._hold()
                begun = time.perf_counter()
            if plan.stream:
                await self._stream(send, plan, begun, body.get("model") or self.config.model, timing)
            else:
                await self._respond(send, plan, begun, body.get("model") or self.config.model, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            if main is not None:
                main.uncancel()
            self.aborted += 1
        except _Died:
            self.died += 1
        else:
            if state["gone"]:
                self.aborted += 1
            else:
                self.finished += 1
        finally:
            state["done"] = True
            watcher.cancel()
            self.running -= 1
            self._kv_in_use -= kv
            timing["ended"] = time.perf_counter()

    def _count_prefix(self, body: dict) -> int:
        """A small prefix cache over blocks of words, so vllm:prefix_cache_* move like vLLM's.

        Returns this request's hits (tokens found in the cache).
        """
        words = _prompt_words(body)
        hits_before = self.prefix_hits
        self.prefix_queries += len(words)
        blocks = self._prefix_blocks
        prefix_hash = 0
        hit = True
        for start in range(0, len(words) - PREFIX_BLOCK_WORDS + 1, PREFIX_BLOCK_WORDS):
            prefix_hash = hash((prefix_hash, *words[start : start + PREFIX_BLOCK_WORDS]))
            if hit and prefix_hash in blocks:
                self.prefix_hits += PREFIX_BLOCK_WORDS
                blocks.move_to_end(prefix_hash)
            else:
                hit = False
                blocks[prefix_hash] = None
        while len(blocks) > PREFIX_CACHE_BLOCKS:
            blocks.popitem(last=False)
        return self.prefix_hits - hits_before

    async def _stream(
        self, send: Send, plan: _Generation, arrived: float, model: str, timing: dict | None = None
    ) -> None:
        timing = timing if timing is not None else {}
        start = arrived
        if plan.first_byte_delay_s:
            await asyncio.sleep(plan.first_byte_delay_s)
            start = time.perf_counter()
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + plan.headers})
        events = _stream_events(plan, model)
        sent = 0
        first_token_at = start + plan.ttft_s
        token_index = 0
        for kind, data in events:
            if plan.die_after_chunks is not None and sent >= plan.die_after_chunks:
                raise _Died()  # returning mid-response makes uvicorn close the connection abruptly
            if plan.stall_after_chunks is not None and sent == plan.stall_after_chunks and plan.stall_s:
                await asyncio.sleep(plan.stall_s)
                first_token_at += plan.stall_s
            if kind == "token":
                await _sleep_until(first_token_at + token_index * plan.itl_s)
                token_index += 1
            await send({"type": "http.response.body", "body": data, "more_body": True})
            sent += 1
            if kind == "token":
                now = time.perf_counter()
                if token_index == 1:
                    timing["first_token"] = now
                    timing["ttft_s"] = now - arrived
                timing["last_token"] = now
                timing["tokens"] = token_index
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _respond(self, send: Send, plan: _Generation, arrived: float, model: str, state: dict) -> None:
        generation_s = plan.ttft_s + max(0, plan.n_tokens - 1) * plan.itl_s
        if plan.die_after_chunks is not None:
            await asyncio.sleep(min(generation_s, plan.ttft_s + plan.die_after_chunks * plan.itl_s))
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            raise _Died()  # headers without a body, then uvicorn closes the connection
        if plan.stall_after_chunks is not None:
            generation_s += plan.stall_s
        delay = plan.first_byte_delay_s + generation_s - (time.perf_counter() - arrived)
        if delay > 0:
            await asyncio.sleep(delay)
        text = "".join(VOCABULARY[i % len(VOCABULARY)] for i in range(plan.n_tokens))
        usage = {
            "prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens + plan.n_tokens,
            "completion_tokens": plan.n_tokens,
            "prompt_tokens_details": None if plan.cached_tokens is None else {"cached_tokens": plan.cached_tokens},
        }  # fmt: skip
        created = int(time.time())
        if plan.chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant", "content": text, "refusal": None, "annotations": None,
                    "audio": None, "function_call": None, "tool_calls": [], "reasoning": None,
                },
                "logprobs": None, "finish_reason": plan.finish_reason, "stop_reason": None, "token_ids": None,
            }  # fmt: skip
            result = {
                "id": f"chatcmpl-{plan.request_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": [choice], "service_tier": None,
                "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage, "prompt_logprobs": None,
                "kv_transfer_params": None,
            }  # fmt: skip
        else:
            choice = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": plan.finish_reason,
                "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
            }  # fmt: skip
            result = {
                "id": f"cmpl-{plan.request_id}", "object": "text_completion", "created": created,
                "model": model, "choices": [choice], "service_tier": None,
                "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage, "kv_transfer_params": None,
            }  # fmt: skip
        state["done"] = True  # from here on a disconnect is the normal end of the exchange
        await _send_json(send, 200, result, plan.headers)


def _stream_events(plan: _Generation, model: str) -> list[tuple[str, bytes]]:
    """Every SSE event of one stream, pre-encoded: ("role"|"token"|"usage", bytes)."""
    created = int(time.time())
    dumps = json.dumps
    # vLLM 0.32 stamps the fingerprint on the chunk that finishes a choice only without include_usage
    # (with it, on the usage chunk instead).
    stamp = "" if plan.include_usage else f',"system_fingerprint":"{SYSTEM_FINGERPRINT}"'
    if plan.chat:
        head = (
            f'data: {{"id":"chatcmpl-{plan.request_id}","object":"chat.completion.chunk",'
            f'"created":{created},"model":{dumps(model)},"choices":[{{"index":0,"delta":{{'
        ).encode()
        events = [(
            "role",
            head + b'"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":null,"prompt_text":null}\n\n',
        )]  # fmt: skip
        middle = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        last = (
            f'}},"logprobs":null,"finish_reason":"{plan.finish_reason}","stop_reason":null,'
            f'"token_ids":null}}]{stamp}}}\n\n'
        )
        for i in range(plan.n_tokens):
            token = dumps(VOCABULARY[i % len(VOCABULARY)]).encode()
            tail = middle if i < plan.n_tokens - 1 else last.encode()
            events.append(("token", head + b'"content":' + token + tail))
        object_ = "chat.completion.chunk"
        id_ = f"chatcmpl-{plan.request_id}"
    else:
        head = (
            f'data: {{"id":"cmpl-{plan.request_id}","object":"text_completion","created":{created},'
            f'"model":{dumps(model)},"choices":[{{"index":0,"text":'
        ).encode()
        middle = (
            b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
        )
        last = (
            f',"logprobs":null,"finish_reason":"{plan.finish_reason}","stop_reason":null,'
            f'"prompt_token_ids":null,"token_ids":null}}]{stamp}}}\n\n'
        ).encode()
        events = []
        for i in range(plan.n_tokens):
            token = dumps(VOCABULARY[i % len(VOCABULARY)]).encode()
            events.append(("token", head + token + (middle if i < plan.n_tokens - 1 else last)))
        object_ = "text_completion"
        id_ = f"cmpl-{plan.request_id}"
    if plan.include_usage:
        usage = {
            "prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens + plan.n_tokens,
            "completion_tokens": plan.n_tokens,
        }  # fmt: skip
        if plan.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": plan.cached_tokens}
        chunk = {
            "id": id_, "object": object_, "created": created, "model": model, "choices": [],
            "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT,
        }  # fmt: skip
        events.append(("usage", b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"))
    return events


async def _watch_disconnect(receive: Receive, main: asyncio.Task | None, state: dict) -> None:
    """Wait for http.disconnect; if the response is not finished yet, cancel the request's task."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not state["done"]:
                state["gone"] = True
                if main is not None:
                    main.cancel()
            return


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _validation_error("json_invalid", "body", f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _validation_error("model_attributes_type", "body", "Input should be a valid dictionary")
    return body


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise _validation_error("list_type", "body.messages", "Input should be a valid list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise _validation_error("missing", f"body.messages.{index}.role", "Field required")


def _validation_error(kind: str, loc: str, msg: str) -> _ApiError:
    detail = {"type": kind, "loc": loc, "msg": msg}
    return _ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _request_id_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    request_id = _header(scope, b"x-request-id")
    return [(b"x-request-id", request_id.encode())] if request_id else []


async def _send_json(send: Send, status: int, payload: Any, headers: list | None = None) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + length + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: _ApiError, headers: list | None = None) -> None:
    envelope = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.status}}
    await _send_json(send, error.status, envelope, headers)


def build_app(config: StandinConfig | None = None) -> Standin:
    """The stand-in engine as a pure ASGI app (serve it with uvicorn)."""
    return Standin(config or StandinConfig())


def run(config: StandinConfig, host: str = "127.0.0.1", port: int = 8200) -> None:
    """Serve the stand-in with uvicorn, on uvloop and httptools when they are installed."""
    import importlib.util

    import uvicorn

    uvicorn.run(
        build_app(config),
        host=host,
        port=port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        log_level=os.environ.get("STANDIN_LOG_LEVEL", "warning"),
        access_log=False,
        backlog=4096,
        timeout_keep_alive=60,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.standin", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag)",
    )
    args = parser.parse_args(argv)
    config = StandinConfig(
        model=args.model, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, tokens=args.tokens,
        max_model_len=args.max_model_len, prompt_tokens_details=args.prompt_tokens_details,
    )  # fmt: skip
    run(config, args.host, args.port)


if __name__ == "__main__":
    main()
