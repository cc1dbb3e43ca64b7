"""History trimming in front of /v1/chat/completions: fit the request into the engine, or say why not.

A pure-ASGI middleware. For a chat request whose model has a `TrimTarget`, it counts the
prompt in the engine's own tokens (`server.gateway.trimming.counter`), and when the messages plus the
answer would not fit the engine's context it drops the oldest turns (`server.gateway.trimming.core`)
and rewrites the body, or — in `strict` mode, or when even the instructions plus the newest
message do not fit — answers 400 `context_length_exceeded` itself.

Budget = max_model_len - answer tokens (the request's `max_completion_tokens`, else `max_tokens`,
else the profile's `trimming.default_max_tokens`), or `trimming.history_budget_tokens` when that
is smaller. The request header `x-trim-mode` may ask for a stricter mode than the profile's
(off < auto < strict), never a looser one.

The caller is told on every counted response: `x-trim-status` (`kept`, `trimmed`,
`unavailable`, `rejected`, `no-budget`), `x-trimmed-messages`, `x-trimmed-tokens` and
`x-prompt-tokens-estimate` (the prompt tokens sent, generation prompt included). Anything the
middleware cannot read — not JSON, not a chat request, a model without a target, a tokenizer
that fails — passes through untouched, so the app and the engine report it as usual.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from server.gateway.errors import InvalidRequest, send_error
from server.gateway.trimming.counter import TokenCounter
from server.gateway.trimming.core import TrimResult, trim_messages
from server.engine.profiles import TrimmingConfig

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

log = logging.getLogger("gateway.trimming")

MODES = ("off", "auto", "strict")
MODE_HEADER = b"x-trim-mode"
# Verification rounds when an exact count shows the estimate was short of the truth.
_MAX_ROUNDS = 3


class TrimTarget(Protocol):
    """What the middleware needs to know about the engine serving one model.

    `tokenize` may also take a keyword `tools` (the request's tool definitions, which many chat
    templates render into the prompt); when it does, their tokens are counted too.
    """

    max_model_len: int | None
    trimming: TrimmingConfig

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool) -> int: ...


@functools.cache
def _accepts_tools(kind: type) -> bool:
    try:
        parameters = inspect.signature(kind.tokenize).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "tools" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


Lookup = Callable[[str], Awaitable[TrimTarget | None]]


def effective_mode(configured: str, requested: str | None) -> str:
    """The stricter of the configured mode and the one the request asks for."""
    if requested is None:
        return configured
    return MODES[max(MODES.index(configured), MODES.index(requested))]


def answer_tokens(request: dict[str, Any], config: TrimmingConfig) -> int | None:
    """Tokens reserved for the answer, or None when the request's value is not a usable integer."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return value
    return config.default_max_tokens


def prompt_budget(max_model_len: int | None, reserved: int, config: TrimmingConfig) -> int | None:
    """Tokens the prompt may use, or None when neither a context length nor a budget is known."""
    budgets = []
    if max_model_len is not None:
        budgets.append(max_model_len - reserved)
    if config.history_budget_tokens is not None:
        budgets.append(config.history_budget_tokens)
    return min(budgets) if budgets else None


@dataclass
class TrimOutcome:
    """What the middleware did to one request; also left in scope["state"]["trimming"]."""

    status: str
    dropped_messages: int = 0
    dropped_tokens: int = 0
    prompt_tokens: int | None = None
    kept: list[dict] | None = None  # the kept messages, when trimmed
    body: bytes | None = None  # the rewritten request body, when trimmed
    error: InvalidRequest | None = None

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-trim-status", self.status.encode())]
        if self.status in {"kept", "trimmed", "rejected"}:
            headers.append((b"x-trimmed-messages", str(self.dropped_messages).encode()))
            headers.append((b"x-trimmed-tokens", str(self.dropped_tokens).encode()))
        if self.prompt_tokens is not None:
            headers.append((b"x-prompt-tokens-estimate", str(self.prompt_tokens).encode()))
        return headers


class TrimmingMiddleware:
    """Fits POST /v1/chat/completions bodies into each model's token budget (see module doc)."""

    def __init__(
        self, app: Any, *, lookup: Lookup, metrics: Any = None, counter: TokenCounter | None = None,
        max_body_bytes: int = 32 * 2**20, path: str = "/v1/chat/completions",
    ) -> None:
        self.app = app
        self.lookup = lookup
        self.metrics = metrics
        self.counter = counter or TokenCounter()
        self.max_body_bytes = max_body_bytes
        self.path = path
        self._failing: set[str] = set()  # models whose tokenizer failure was already logged
        self._background: set[asyncio.Task] = set()
        self.max_background = 64  # counting tasks in flight; beyond that, new messages wait for the next turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        request = _chat_request(body)
        outcome = None
        if request is not None:
            requested = _header(scope, MODE_HEADER)
            if requested is not None and requested.strip().lower() not in MODES:
                await send_error(send, InvalidRequest(
                    f"Header x-trim-mode must be one of {', '.join(MODES)}; got {requested!r}.",
                    param="x-trim-mode", code="invalid_trim_mode",
                ))
                return
            outcome = await self._decide(request, requested and requested.strip().lower())
        if outcome is None:
            await self.app(scope, _replay(body, receive), send)
            return
        scope.setdefault("state", {})["trimming"] = outcome
        if outcome.error is not None:
            outcome.error.headers = outcome.response_headers()
            await send_error(send, outcome.error)
            return
        if outcome.body is not None:
            scope = dict(scope, headers=_with_length(scope["headers"], len(outcome.body)))
            body = outcome.body
        await self.app(scope, _replay(body, receive), _adding_headers(send, outcome.response_headers()))

    async def _decide(self, request: dict[str, Any], requested: str | None) -> TrimOutcome | None:
        model = request["model"]
        target = await self.lookup(model)
        if target is None:
            return None
        mode = effective_mode(target.trimming.mode, requested)
        if mode == "off":
            return None
        reserved = answer_tokens(request, target.trimming)
        if reserved is None:
            return None  # a bad max_tokens: let the engine say so
        budget = prompt_budget(target.max_model_len, reserved, target.trimming)
        if budget is None:
            return TrimOutcome(status="no-budget")
        messages = request["messages"]
        generation_prompt = bool(request.get("add_generation_prompt", True)) and not request.get(
            "continue_final_message", False
        )
        try:
            tools = request.get("tools") if isinstance(request.get("tools"), list) else None
            outcome = await self._fit(
                model, target, messages, budget, mode, generation_prompt, target.max_model_len,
                reserved, tools,
            )
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure: pass through, untrimmed
            if model not in self._failing:
                self._failing.add(model)
                log.warning("token counting for model %s failed, passing requests through "
                            "untrimmed until it works again: %r", model, exc)
            return TrimOutcome(status="unavailable")
        self._failing.discard(model)
        if outcome.status == "trimmed":
            request = dict(request, messages=outcome.kept)
            outcome.body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()
            if self.metrics is not None:
                self.metrics.trimmed(model, outcome.dropped_messages, outcome.dropped_tokens)
        return outcome

    async def _fit(
        self, model: str, target: TrimTarget, messages: list[dict], budget: int, mode: str,
        generation_prompt: bool, max_model_len: int | None, reserved: int, tools: list | None,
    ) -> TrimOutcome:
        tools = tools if tools and _accepts_tools(type(target)) else None
        counts = self.counter.estimate_cached(model, messages, generation_prompt, tools)
        if counts is not None and counts.unseen:
            if not self.counter.needs_verification(model, counts.total, budget):
                # Fits even with generous bounds for the new messages: send it now, and count
                # them in the background for the next turn.
                self._learn_later(model, target, counts.unseen)
                return TrimOutcome(status="kept")
            counts = None
        if counts is None:
            counts = await self.counter.count(model, target.tokenize, messages, generation_prompt, tools)
        by_position = dict(zip(map(id, messages), counts.per_message, strict=True))

        def count(message: dict) -> int:
            return by_position[id(message)]

        limit = budget
        for _ in range(_MAX_ROUNDS):
            result = trim_messages(messages, limit, count, overhead=counts.overhead)
            if not result.fits or (mode == "strict" and result.trimmed):
                return self._refusal(model, result, budget, mode, max_model_len, reserved)
            sent = result.kept_tokens
            if self.counter.needs_verification(model, sent, budget):
                sent = await self.counter.count_exact(
                    model, target.tokenize, result.messages, generation_prompt, estimate=sent,
                    tools=tools,
                )
            if sent <= budget:
                return _outcome(result, sent)
            limit -= sent - budget  # the estimate was short: ask for that much less
        overshoot = TrimResult(
            messages=messages, dropped_messages=0, dropped_tokens=0, kept_tokens=sent,
            budget=budget, fits=False, required_tokens=sent,
        )
        return self._refusal(model, overshoot, budget, mode, max_model_len, reserved)

    @property
    def counting_in_background(self) -> int:
        """Background tasks still counting new messages (see `TokenCounter.learn`)."""
        return len(self._background)

    def _learn_later(self, model: str, target: TrimTarget, messages: list[dict]) -> None:
        if len(self._background) >= self.max_background:
            return
        task = asyncio.create_task(self._learn(model, target, messages))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _learn(self, model: str, target: TrimTarget, messages: list[dict]) -> None:
        try:
            await self.counter.learn(model, target.tokenize, messages)
        except Exception as exc:  # noqa: BLE001 - the next request counts them again
            log.debug("background token count for model %s failed: %r", model, exc)

    @staticmethod
    def _refusal(
        model: str, result: TrimResult, budget: int, mode: str, max_model_len: int | None,
        reserved: int,
    ) -> TrimOutcome:
        if mode == "strict" and result.fits:
            tokens = result.kept_tokens + result.dropped_tokens
            why = ("History trimming is strict for this request, so no messages were dropped. "
                   "Shorten the conversation or send fewer tokens.")
        else:
            tokens = result.required_tokens
            why = ("Even the system prompt plus the newest message (with any tool call it "
                   "answers) does not fit. Shorten them or ask for fewer answer tokens.")
        origin = (f"max_model_len {max_model_len} minus {reserved} tokens reserved for the answer"
                  if max_model_len is not None and budget == max_model_len - reserved
                  else "the model's history_budget_tokens")
        message = (f"This model's prompt budget is {budget} tokens ({origin}); the request's "
                   f"messages need {tokens} tokens. {why}")
        error = InvalidRequest(message, param="messages", code="context_length_exceeded")
        return TrimOutcome(status="rejected", prompt_tokens=tokens, error=error)


def _outcome(result: TrimResult, sent: int) -> TrimOutcome:
    if not result.trimmed:
        return TrimOutcome(status="kept", prompt_tokens=sent)
    return TrimOutcome(
        status="trimmed", dropped_messages=result.dropped_messages,
        dropped_tokens=result.dropped_tokens, prompt_tokens=sent, kept=result.messages,
    )


def _chat_request(body: bytes) -> dict[str, Any] | None:
    """The parsed body if it looks like a chat request we can trim, else None."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(request, dict) or not isinstance(request.get("model"), str):
        return None
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return None
    return request


async def _read_body(receive: Receive, limit: int) -> tuple[list[bytes] | None, bool]:
    """The request body's chunks, and whether it was read whole (False: over `limit`)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return chunks, True
        if size > limit:
            return chunks, False


def _replay(body: bytes, receive: Receive, *, more_body: bool = False) -> Receive:
    """A receive that hands the app `body` first, then whatever the client sends next."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more_body}
        return await receive()

    return replay


def _adding_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *headers])
        await send(message)

    return wrapped


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() not in {b"content-length", b"transfer-encoding"}]
    return [*kept, (b"content-length", str(length).encode())]
