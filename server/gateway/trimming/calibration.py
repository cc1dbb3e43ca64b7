"""What one model's chat template adds around the messages, measured once with probe conversations.

A rendered chat template is, for most templates, a fixed per-call part (a BOS token, a default
system block), then one block per message, then the generation prompt. So once per model the
token counter (`server.gateway.trimming.counter`) calls `calibrate`, which tokenizes a few probe
conversations and measures

- ``per_call``: tokens every tokenize call adds once (``c([a]) + c([b]) - c([a, b])``),
- ``generation_prompt``: what ``add_generation_prompt`` adds,
- ``empty_message``: what a message with empty content costs (its role markers),
- ``trusted``: whether the per-message counts of a three-message probe add up to at least its
  whole count (an over-estimate only trims a little early; a short one could overflow).

Tool definitions (the request's ``tools``) are rendered by many templates into the prompt once;
`tools_cost` measures their cost (``c([probe], tools) - c([probe])``), which the counter caches
per distinct tool list and adds to the overhead, when the tokenizer accepts ``tools``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server.gateway.trimming.core import Message

# tokenize(messages, add_generation_prompt) -> tokens; with tools, also a `tools=` keyword.
Tokenize = Callable[..., Awaitable[int]]

# Probe conversation for calibration: ordinary, template-friendly messages.
PROBES: tuple[Message, ...] = (
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
)


@dataclass
class Calibration:
    """What one model's chat template adds around the messages, as measured."""

    per_call: int
    generation_prompt: int
    # Net tokens of a user message with empty content (role markers): the floor of any message.
    empty_message: int
    # No estimate has been found short of the exact count (probe included).
    trusted: bool
    # Largest shortfall (exact - estimate > 0) seen by count_exact.
    max_short: int = 0

    @property
    def floor(self) -> int:
        """The least a message is taken to cost: half the template's cost of an empty one, at least 1."""
        return max(1, self.empty_message // 2)


async def calibrate(tokenize: Tokenize) -> Calibration:
    """Measure a model's template with seven tokenize calls, made at once."""
    a, b, c = PROBES
    ca, cb, cc, cab, cabc, cabc_gen, empty = await asyncio.gather(
        tokenize([a], False),
        tokenize([b], False),
        tokenize([c], False),
        tokenize([a, b], False),
        tokenize([a, b, c], False),
        tokenize([a, b, c], True),
        tokenize([{"role": "user", "content": ""}], False),
    )
    per_call = max(0, ca + cb - cab)
    estimate = ca + cb + cc - 2 * per_call
    return Calibration(
        per_call=per_call,
        generation_prompt=max(0, cabc_gen - cabc),
        empty_message=max(0, empty - per_call),
        trusted=cabc <= estimate and ca + cb - cab >= 0,
        max_short=max(0, cabc - estimate),
    )


async def tools_cost(tokenize: Tokenize, tools: list[Any]) -> int:
    """The tokens `tools` add to a prompt, from two tokenize calls of one probe message."""
    probe = [PROBES[1]]
    with_tools, without = await asyncio.gather(
        tokenize(probe, False, tools=tools),
        tokenize(probe, False),
    )
    return max(0, with_tools - without)
