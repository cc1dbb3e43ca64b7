"""The trimming decision for one conversation (as chat messages), pure: no I/O, no tokenizer, no clock.

Given the messages, what each one costs in the model's tokens (from `counter.TokenCounter`), the
model's context length and trimming settings, `decide` says what to send: everything (`kept`),
fewer messages (`trimmed`), or a 400 `context_length_exceeded` (`rejected`). The step
(`server.gateway.trimming.step`) asks the counter for the counts, calls `decide`, lets the counter
verify the chosen prompt when it comes close to the budget, and forwards.

Budget = max_model_len - answer tokens (the request's `max_completion_tokens`, else `max_tokens`;
a Responses request's `max_output_tokens`; else the profile's `trimming.default_max_tokens`), or
`trimming.history_budget_tokens` when that is smaller. Modes: `auto` cuts with watermarks
(`watermark`: down to the low mark, then the cut stays put so the prefix cache keeps hitting),
`window` keeps the longest suffix that fits (`core.trim_messages`: the cut moves every turn),
`strict` refuses what does not fit, `off` sends everything. The request header `x-trim-mode`
may ask for a stricter mode than the profile's (off < window = auto < strict), never a looser
one; between `window` and `auto` it chooses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from server.config import TrimmingConfig
from server.gateway.errors import InvalidRequest
from server.gateway.http.asgi import Headers
from server.gateway.trimming.core import Message, TrimResult, trim_messages
from server.gateway.trimming.watermark import low_mark_tokens, watermark_trim

MODES = ("off", "window", "auto", "strict")
# How much a mode changes a request: a request may ask for more, or the same, never less.
_STRICTNESS = {"off": 0, "window": 1, "auto": 1, "strict": 2}


class Outcome(StrEnum):
    """What trimming did to a request: the value of its `x-trim-status` header."""

    KEPT = "kept"  # sent as the client wrote it
    TRIMMED = "trimmed"  # the oldest turns were dropped to fit
    UNAVAILABLE = "unavailable"  # the tokens could not be counted: sent untrimmed
    REJECTED = "rejected"  # refused with 400 context_length_exceeded
    NO_BUDGET = "no-budget"  # neither a context length nor a history budget is known: sent untrimmed
    # The engine prepends history the gateway cannot see (a Responses `previous_response_id`): sent untrimmed.
    PREVIOUS_RESPONSE = "previous-response"


# The outcomes whose responses say how many messages and tokens were dropped.
_COUNTED = frozenset({Outcome.KEPT, Outcome.TRIMMED, Outcome.REJECTED})


def parse_mode(requested: str | None) -> str | None:
    """The mode an `x-trim-mode` header asks for (None without one); InvalidRequest for an unknown one."""
    if requested is None:
        return None
    mode = requested.strip().lower()
    if mode not in MODES:
        raise InvalidRequest(
            f"Header x-trim-mode must be one of {', '.join(MODES)}; got {requested!r}.",
            param="x-trim-mode",
            code="invalid_trim_mode",
        )
    return mode


def effective_mode(configured: str, requested: str | None) -> str:
    """The stricter of the configured mode and the one the request asks for (the request's when
    they are as strict: `window` or `auto`)."""
    if requested is None or _STRICTNESS[requested] < _STRICTNESS[configured]:
        return configured
    return requested


def answer_tokens(
    request: Mapping[str, Any], config: TrimmingConfig, keys: Sequence[str] = ("max_completion_tokens", "max_tokens")
) -> int | None:
    """Tokens reserved for the answer: the first of the request's `keys` it sets (a Responses
    request's is `max_output_tokens`), else the profile's default; None when the request's value
    is not a usable integer."""
    for key in keys:
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


@dataclass(frozen=True, slots=True)
class Budget:
    """The prompt's token budget, and where it comes from (for the refusal's message)."""

    tokens: int
    max_model_len: int | None
    reserved: int  # tokens kept free for the answer

    def origin(self) -> str:
        if self.max_model_len is not None and self.tokens == self.max_model_len - self.reserved:
            return f"max_model_len {self.max_model_len} minus {self.reserved} tokens reserved for the answer"
        return "the model's history_budget_tokens"


@dataclass(slots=True)
class TrimOutcome:
    """What trimming did to one request, and what the client is told about it."""

    status: Outcome
    dropped_messages: int = 0
    dropped_tokens: int = 0
    prompt_tokens: int | None = None  # the prompt tokens sent, when counted
    kept: list[Message] | None = None  # the messages to send instead, when trimmed
    body: dict[str, Any] | None = None  # the request body to send instead, when trimmed (set by the step)
    error: InvalidRequest | None = None  # the refusal, when rejected

    def response_headers(self) -> Headers:
        """`x-trim-status`, and for counted requests `x-trimmed-*` and `x-prompt-tokens-estimate`."""
        headers = [(b"x-trim-status", self.status.value.encode())]
        if self.status in _COUNTED:
            headers.append((b"x-trimmed-messages", str(self.dropped_messages).encode()))
            headers.append((b"x-trimmed-tokens", str(self.dropped_tokens).encode()))
        if self.prompt_tokens is not None:
            headers.append((b"x-prompt-tokens-estimate", str(self.prompt_tokens).encode()))
        return headers


def decide(
    messages: Sequence[Message],
    per_message: Sequence[int],
    overhead: int,
    budget: Budget,
    mode: str,
    *,
    limit: int | None = None,
    low_mark: float = 0.65,
    param: str = "messages",
) -> TrimOutcome:
    """Fit `messages` (costing `per_message` tokens each, plus `overhead` once) into `budget`.

    `mode` is `auto`, `window` or `strict` (`off` never gets here). `limit` (default: the
    budget) is what the cut aims for: the caller lowers it when an exact count showed the
    estimate was short. `low_mark` is the fraction of it a watermark cut goes down to. The
    outcome is `kept` or `trimmed` with the estimated `prompt_tokens`, or `rejected` with the
    error to answer (naming `param`, the request's field that holds the conversation).
    """
    counts = dict(zip(map(id, messages), per_message, strict=True))

    def count(message: Message) -> int:
        return counts[id(message)]

    high = budget.tokens if limit is None else limit
    if mode == "auto":
        result = watermark_trim(messages, high, low_mark_tokens(high, low_mark), count, overhead=overhead)
    else:
        result = trim_messages(messages, high, count, overhead=overhead)
    if not result.fits or (mode == "strict" and result.trimmed):
        return refusal(result, budget, mode, param)
    if not result.trimmed:
        return TrimOutcome(Outcome.KEPT, prompt_tokens=result.kept_tokens)
    return TrimOutcome(
        Outcome.TRIMMED,
        dropped_messages=result.dropped_messages,
        dropped_tokens=result.dropped_tokens,
        prompt_tokens=result.kept_tokens,
        kept=result.messages,
    )


def refusal(result: TrimResult, budget: Budget, mode: str, param: str = "messages") -> TrimOutcome:
    """The 400 for a request that does not fit (or, in strict mode, would need trimming)."""
    if mode == "strict" and result.fits:
        tokens = result.kept_tokens + result.dropped_tokens
        why = (
            "History trimming is strict for this request, so no messages were dropped. "
            "Shorten the conversation or send fewer tokens."
        )
    else:
        tokens = result.required_tokens
        why = (
            "Even the system prompt plus the newest message (with any tool call it "
            "answers) does not fit. Shorten them or ask for fewer answer tokens."
        )
    message = (
        f"This model's prompt budget is {budget.tokens} tokens ({budget.origin()}); the request's "
        f"messages need {tokens} tokens. {why}"
    )
    error = InvalidRequest(message, param=param, code="context_length_exceeded")
    return TrimOutcome(Outcome.REJECTED, prompt_tokens=tokens, error=error)


def overshoot(
    messages: Sequence[Message], sent: int, budget: Budget, mode: str, param: str = "messages"
) -> TrimOutcome:
    """The refusal when exact counts kept exceeding the budget however far the cut was moved."""
    result = TrimResult(
        messages=list(messages),
        dropped_messages=0,
        dropped_tokens=0,
        kept_tokens=sent,
        budget=budget.tokens,
        fits=False,
        required_tokens=sent,
    )
    return refusal(result, budget, mode, param)
