"""Which of a request's new messages the token counter tokenizes, and what the others are taken to cost.

The work per request is bounded: `choose` picks at most `max_calls` new messages (the leading
instructions first, then the newest messages backwards), and only as far back as a message
could still be part of a prompt that fits the budget (every message costs at least
`Calibration.floor`, half the template's cost of an empty message). `fill` gives every other
new message an estimate from its size, without a call: the upper bound (`upper_bound`) below
where the message could still be sent (an estimate too high only trims a little more), a guess
from the tokens per byte of the counted messages where it cannot. A later turn counts the next
ones. These are pure functions of the conversation, the counter's cache and the calibration;
`server.gateway.trimming.counter` makes the calls.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Sequence

from server.gateway.trimming.calibration import Calibration
from server.gateway.trimming.core import Message, leading_instructions
from server.gateway.trimming.keys import Key

CacheKey = tuple[str, Key]  # (model, message_key(message)) or (model, tools_key(tools))


def choose(
    keys: list[CacheKey],
    messages: Sequence[Message],
    cache: OrderedDict[CacheKey, int],
    calibration: Calibration,
    overhead: int,
    budget: int | None,
    max_calls: int,
) -> dict[CacheKey, Message]:
    """The new messages to tokenize (at most `max_calls`): the instructions, then the newest backwards.

    Walks the instructions, then the conversation from its newest message back, adding what
    each message costs at least (its cached count, else the floor); it stops at `max_calls`
    new messages or where even those least costs pass `budget`, since an older message can
    then not be in any prompt that fits (the newest message is counted whatever its cost: it
    is always sent). Messages found in `cache` are marked recently used.
    """
    floor = calibration.floor
    head = leading_instructions(messages)
    order = itertools.chain(range(head), range(len(messages) - 1, head - 1, -1))
    chosen: dict[CacheKey, Message] = {}
    least = overhead
    for index in order:
        key = keys[index]
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
            least += value
            continue
        least += floor
        if key in chosen:
            continue
        could_fit = budget is None or index < head or index == len(messages) - 1 or least <= budget
        if len(chosen) >= max_calls or not could_fit:
            break
        chosen[key] = messages[index]
    return chosen


def fill(
    messages: Sequence[Message],
    known: list[int | None],
    calibration: Calibration,
    overhead: int,
    budget: int | None,
) -> list[int]:
    """Counts for every message: `known` where counted, else an estimate from the size.

    A message not counted that could still be part of a prompt within `budget` gets the
    upper bound (`upper_bound`: trimming must not overflow because of it). One older than
    that cannot be kept whatever it costs, so it gets a closer guess, from the tokens per byte
    of the messages counted here: it only moves the dropped-token figures and the watermark
    replay, and should not inflate them.
    """
    floor = calibration.floor
    head = leading_instructions(messages)
    least = overhead + sum(floor if value is None else value for value in known[:head])
    beyond = head  # messages[head:beyond] cannot be in any prompt within the budget
    for index in range(len(messages) - 1, head - 1, -1):
        value = known[index]
        least += floor if value is None else value
        if budget is not None and index < len(messages) - 1 and least > budget:
            beyond = index + 1
            break
    counted = [(message, value) for message, value in zip(messages, known, strict=True) if value is not None]
    counted_bytes = sum(payload_bytes(message) for message, _ in counted)
    per_byte = sum(value for _, value in counted) / counted_bytes if counted_bytes else None
    out: list[int] = []
    for index, (message, value) in enumerate(zip(messages, known, strict=True)):
        if value is None:
            if head <= index < beyond and per_byte is not None:
                value = max(floor, round(payload_bytes(message) * per_byte))
            else:
                value = upper_bound(message, calibration)
        out.append(value)
    return out


def upper_bound(message: Message, calibration: Calibration) -> int:
    """What a message not counted yet is taken to cost: more than any tokenizer that spends at most
    one token per UTF-8 byte (byte-level BPE, byte fallback) renders it in, template included."""
    return 2 * payload_bytes(message) + calibration.empty_message + 16


def payload_bytes(message: Message) -> int:
    """The size of a message's text in UTF-8 bytes (its role and content, else its whole JSON)."""
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str):
        return len(content.encode()) + len(str(message.get("role", "")))
    return len(json.dumps(message, ensure_ascii=False).encode())
