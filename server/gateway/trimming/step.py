"""History trimming as a request step: fit a chat or Responses request into its engine, or say why not.

The router parses each request once into a `GatewayRequest` and calls `HistoryTrimming` on it
before the proxy. For an endpoint that trims history (chat's `messages`; a Responses create's
`instructions` + `input`, read as chat messages by `history.responses_history`), whose model has
a `TrimTarget`, the step

1. reads: the model's budget (`decision.prompt_budget`) and the mode (profile, `x-trim-mode`);
2. counts: `counter.TokenCounter.estimate` (from its cache when it can; a tokenize call per new
   message when it must, at most `TokenCounter.max_calls` of them per request);
3. decides: `decision.decide`, a pure function (keep, trim, or refuse);
4. verifies: the counter recounts the chosen prompt exactly when it comes close to the budget;
5. forwards: a trimmed body replaces the request's (`GatewayRequest.replace_body`), and the
   `x-trim-*` headers join the response (`GatewayRequest.response_headers`).

A Responses request with a `previous_response_id` is sent untouched with `x-trim-status:
previous-response`: the engine prepends the stored conversation, which the gateway never sees.

A refusal raises `InvalidRequest` (400 `context_length_exceeded`, with the `x-trim-*` headers).
Anything the step cannot count — a model without a target, an unusable `max_tokens`, a tokenizer
that fails, an unexpected error — passes the request through untrimmed, so the engine reports
it as usual; a failing tokenizer is logged once per model and answered with `x-trim-status:
unavailable`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from server.config import TrimmingConfig
from server.gateway.request.endpoints import Endpoint
from server.gateway.request.request import GatewayRequest
from server.gateway.trimming.core import Message
from server.gateway.trimming.counter import TokenCounter
from server.gateway.trimming.decision import (
    Budget,
    Outcome,
    TrimOutcome,
    answer_tokens,
    decide,
    effective_mode,
    overshoot,
    parse_mode,
    prompt_budget,
)
from server.gateway.trimming.history import History, chat_history, hides_history, responses_history

log = logging.getLogger("gateway.trimming")

MODE_HEADER = b"x-trim-mode"
# Verification rounds when an exact count shows the estimate was short of the truth.
_MAX_ROUNDS = 3


class TrimTarget(Protocol):
    """What trimming needs to know about the engines serving one model.

    `tokenize` may also take a keyword `tools` (the request's tool definitions, which many chat
    templates render into the prompt); when it does, their tokens are counted too.
    """

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def trimming(self) -> TrimmingConfig: ...

    async def tokenize(self, messages: list[Message], add_generation_prompt: bool) -> int: ...


Lookup = Callable[[str], Awaitable[TrimTarget | None]]


class TrimMetrics(Protocol):
    def trimmed(self, model: str, messages: int, tokens: int) -> None: ...


@functools.cache
def accepts_tools(kind: type[TrimTarget]) -> bool:
    """Whether `kind.tokenize` takes the request's tool definitions (a `tools` keyword)."""
    try:
        parameters = inspect.signature(kind.tokenize).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "tools" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


class HistoryTrimming:
    """The request step that fits chat histories into each model's token budget (see module doc)."""

    def __init__(
        self, *, lookup: Lookup, metrics: TrimMetrics | None = None, counter: TokenCounter | None = None
    ) -> None:
        self.lookup = lookup
        self.metrics = metrics
        self.counter = counter if counter is not None else TokenCounter()
        self._failing: set[str] = set()  # models whose tokenizer failure was already logged

    @property
    def counting_in_background(self) -> int:
        """Background tasks still counting new messages (see `TokenCounter.learn_later`)."""
        return self.counter.counting_in_background

    async def __call__(self, request: GatewayRequest) -> None:
        read = reader(request.endpoint)
        if read is None:
            return
        requested = parse_mode(request.header(MODE_HEADER))
        outcome = await self.outcome(request.model, request.body, requested, read)
        if outcome is None:
            return
        headers = outcome.response_headers()
        if outcome.status is Outcome.PREVIOUS_RESPONSE:
            log.debug("request %s: continues a stored response; sent untrimmed", request.request_id)
        if outcome.error is not None:
            outcome.error.headers = headers
            raise outcome.error
        request.response_headers.extend(headers)
        if outcome.body is not None:
            request.replace_body(outcome.body)
            request.trimmed_messages = outcome.dropped_messages
            request.trimmed_tokens = outcome.dropped_tokens
            if self.metrics is not None:
                self.metrics.trimmed(request.model, outcome.dropped_messages, outcome.dropped_tokens)

    async def outcome(
        self,
        model: str,
        body: dict[str, Any],
        requested: str | None,
        read: Reader = chat_history,
    ) -> TrimOutcome | None:
        """What to do with the request `body` for `model` (its conversation read by `read`), when
        the client asked for mode `requested` (already checked by `parse_mode`); None to pass it
        through without a word. A trimmed outcome carries the body to send (`body`)."""
        try:
            target = await self.lookup(model)
        except Exception:  # trimming never turns a request into a 500
            log.exception("trimming: looking up model %s failed; passing the request through", model)
            return None
        if target is None:
            return None
        config = target.trimming
        mode = effective_mode(config.mode, requested)
        if mode == "off":
            return None  # before reading the conversation: a model that is not trimmed pays nothing
        if read is responses_history and hides_history(body):
            return TrimOutcome(Outcome.PREVIOUS_RESPONSE)
        history = read(body)
        if history is None:
            return None
        reserved = answer_tokens(body, config, history.answer_keys)
        if reserved is None:
            return None  # a bad max_tokens: let the engine say so
        tokens = prompt_budget(target.max_model_len, reserved, config)
        if tokens is None:
            return TrimOutcome(Outcome.NO_BUDGET)
        budget = Budget(tokens, target.max_model_len, reserved)
        try:
            outcome = await self._fit(model, target, history, budget, mode)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure: pass through, untrimmed
            if model not in self._failing:
                self._failing.add(model)
                log.warning(
                    "token counting for model %s failed, passing requests through untrimmed until it works again: %r",
                    model,
                    exc,
                )
            return TrimOutcome(Outcome.UNAVAILABLE)
        self._failing.discard(model)
        if outcome.kept is not None:
            outcome.body, outcome.dropped_messages = history.trimmed(outcome.dropped_messages)
        return outcome

    async def _fit(self, model: str, target: TrimTarget, history: History, budget: Budget, mode: str) -> TrimOutcome:
        messages, generation_prompt = history.messages, history.generation_prompt
        tools = history.tools if accepts_tools(type(target)) else None
        param = history.param
        tokenize, counter, low_mark = target.tokenize, self.counter, target.trimming.low_mark
        counts = await counter.estimate(model, tokenize, messages, generation_prompt, budget.tokens, tools)
        if counts.unseen and not counter.needs_verification(model, counts.total, budget.tokens):
            return TrimOutcome(Outcome.KEPT)  # fits even with upper bounds: sent before it is counted
        limit = budget.tokens
        sent = counts.total
        for _ in range(_MAX_ROUNDS):
            outcome = decide(
                messages,
                counts.per_message,
                counts.overhead,
                budget,
                mode,
                limit=limit,
                low_mark=low_mark,
                param=param,
            )
            if outcome.prompt_tokens is None or outcome.status is Outcome.REJECTED:
                return outcome
            kept = outcome.kept if outcome.kept is not None else messages
            sent = await counter.verify(
                model, tokenize, kept, generation_prompt, outcome.prompt_tokens, budget.tokens, tools
            )
            if sent <= budget.tokens:
                outcome.prompt_tokens = sent
                return outcome
            limit -= sent - budget.tokens  # the estimate was short: ask for that much less
        return overshoot(messages, sent, budget, mode, param)


Reader = Callable[[dict[str, Any]], History | None]


def reader(endpoint: Endpoint) -> Reader | None:
    """How to read the conversation of a request to `endpoint`; None where history is not trimmed.

    A Responses create (the endpoint that stores responses) is read as `instructions` + `input`."""
    if not endpoint.trims_history:
        return None
    return responses_history if endpoint.stores_responses else chat_history
