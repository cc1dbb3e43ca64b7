"""Fit an OpenAI chat history into a token budget by dropping its oldest turns.

This is the pure part of history trimming: no I/O, no tokenizer. The caller passes a `count`
function (tokens one message adds to the rendered chat template) and the fixed `overhead` of one
rendered prompt (generation prompt, per-call tokens such as BOS); `server.gateway.trimming.counter` supplies
both from the engine's own tokenizer.

What is kept, in order of precedence:

- every leading ``system``/``developer`` message (the instructions) and the newest message;
- an assistant message with ``tool_calls`` and the ``tool`` messages answering it go or stay
  together, and a trimmed history never starts with a ``tool`` message;
- when something is dropped, the kept turns start on a ``user`` message if any such cut fits;
- within that, the longest suffix of the conversation that fits.

If even the instructions plus the newest message (with the tool call it answers) do not fit,
nothing is mangled: the result says so (``fits`` is False) and carries both numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # one OpenAI chat message, as parsed from the request body

INSTRUCTION_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class TrimResult:
    """What trimming kept, and what it cost.

    ``kept_tokens`` includes the overhead. When ``fits`` is False, ``messages`` is the input
    unchanged and ``required_tokens`` is the smallest prompt trimming could have produced.
    """

    messages: list[Message]
    dropped_messages: int
    dropped_tokens: int
    kept_tokens: int
    budget: int
    fits: bool = True
    required_tokens: int = 0

    @property
    def trimmed(self) -> bool:
        return self.dropped_messages > 0


def leading_instructions(messages: Sequence[Message]) -> int:
    """How many messages at the start are system/developer instructions."""
    head = 0
    while head < len(messages) and messages[head].get("role") in INSTRUCTION_ROLES:
        head += 1
    return head


def valid_cuts(messages: Sequence[Message], head: int) -> list[int]:
    """Indices i > head where the conversation may resume after dropping messages[head:i].

    A cut is valid when messages[i] is not a ``tool`` message and no kept ``tool`` message
    answers an assistant ``tool_calls`` message that would be dropped. The newest message is
    always kept, so every cut is <= len(messages) - 1.
    """
    n = len(messages)
    # For each tool result, the index of the assistant message that issued its call.
    issuer_of: dict[int, int] = {}
    latest_issuer: dict[str, int] = {}
    previous_assistant_with_calls: int | None = None
    for index in range(head, n):
        message = messages[index]
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            previous_assistant_with_calls = index
            for call in message["tool_calls"]:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    latest_issuer[call["id"]] = index
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str):
                if call_id in latest_issuer:
                    issuer_of[index] = latest_issuer[call_id]
            elif previous_assistant_with_calls is not None:
                # No id at all: bind it to the nearest assistant that made calls.
                issuer_of[index] = previous_assistant_with_calls
    # Walking from the end, track the earliest issuer any kept tool result needs.
    cuts: list[int] = []
    earliest_needed = n
    for index in range(n - 1, head, -1):
        if index in issuer_of:
            earliest_needed = min(earliest_needed, issuer_of[index])
        if messages[index].get("role") != "tool" and index <= earliest_needed:
            cuts.append(index)
    cuts.reverse()
    return cuts


def trim_messages(
    messages: Sequence[Message],
    budget: int,
    count: Callable[[Message], int],
    *,
    overhead: int = 0,
) -> TrimResult:
    """Keep the instructions, the newest message and the longest suffix that fits in `budget`.

    `count(message)` is the number of tokens the message adds to the rendered prompt (>= 0);
    `overhead` is added once. The kept messages' counts plus `overhead` never exceed `budget`
    when ``fits`` is True.
    """
    messages = list(messages)
    n = len(messages)
    counts = [count(message) for message in messages]
    total = sum(counts) + overhead
    if total <= budget:
        return TrimResult(
            messages=messages,
            dropped_messages=0,
            dropped_tokens=0,
            kept_tokens=total,
            budget=budget,
        )
    head = leading_instructions(messages)
    cuts = valid_cuts(messages, head)
    head_tokens = sum(counts[:head]) + overhead
    # suffix[i] = tokens of messages[i:]
    suffix = [0] * (n + 1)
    for index in range(n - 1, -1, -1):
        suffix[index] = suffix[index + 1] + counts[index]
    if not cuts:
        # Nothing may be dropped (only instructions, or one conversational unit).
        return _does_not_fit(messages, budget, total)
    minimum = head_tokens + suffix[cuts[-1]]
    if minimum > budget:
        return _does_not_fit(messages, budget, minimum)
    fitting = [cut for cut in cuts if head_tokens + suffix[cut] <= budget]
    on_user = [cut for cut in fitting if messages[cut].get("role") == "user"]
    cut = (on_user or fitting)[0]
    kept_tokens = head_tokens + suffix[cut]
    return TrimResult(
        messages=messages[:head] + messages[cut:],
        dropped_messages=cut - head,
        dropped_tokens=total - kept_tokens,
        kept_tokens=kept_tokens,
        budget=budget,
    )


def _does_not_fit(messages: list[Message], budget: int, required: int) -> TrimResult:
    return TrimResult(
        messages=messages,
        dropped_messages=0,
        dropped_tokens=0,
        kept_tokens=required,
        budget=budget,
        fits=False,
        required_tokens=required,
    )
