"""Exact prompt token counts from the engine's own tokenizer and chat template, cached per message.

The engine is asked through an injected `tokenize(messages, add_generation_prompt) -> int`
(vLLM's ``/tokenize`` with ``messages``); this module does no HTTP itself.

How a count is made cheap. A rendered chat template is, for most templates, a fixed per-call part
(a BOS token, a default system block), then one block per message, then the generation prompt.
So once per model the counter *calibrates*: it tokenizes a few probe conversations and measures

- ``per_call``: tokens every tokenize call adds once (``c([a]) + c([b]) - c([a, b])``),
- ``generation_prompt``: what ``add_generation_prompt`` adds,
- ``trusted``: whether the per-message counts of a three-message probe add up to at least its
  whole count (an over-estimate only trims a little early; a short one could overflow).

Each message is then tokenized alone, once: its net count ``c([m]) - per_call`` is cached under
a hash of its content (bounded LRU), so a conversation that grows by one message costs one small
tokenize call. The estimate of a whole prompt is ``per_call + sum(net) + generation_prompt``.

The work per request is bounded: at most `max_calls` new messages are tokenized for one request
(the leading instructions first, then the newest messages backwards), and only as far back as a
message could still be part of a prompt that fits the budget (every message costs at least
`floor`, half the template's cost of an empty message). Every other new message is estimated
from its size without a call and listed in `unseen`: the upper bound below where the message could
still be sent (an estimate too high only trims a little more), a guess from the tokens per byte of
the counted messages where it cannot; a later turn counts the next ones. One request thus makes at most
7 (calibration, once per model) + 2 (a new tool list) + `max_calls` + the verification rounds
calls, and adds at most `max_calls` entries to the shared cache, so it cannot flush it.

Not even that call is waited for when it cannot matter: `estimate_cached` answers from the cache
alone, with a generous upper bound (twice the message's UTF-8 bytes, plus the template's cost of
an empty message) for messages not seen yet. If the prompt fits its budget even so, the caller
sends it at once and lets `learn` count the new messages in the background for the next turn.

Tool definitions (the request's ``tools``) are rendered by many templates into the prompt once;
their cost is measured once per distinct tool list (``c([probe], tools) - c([probe])``) and added
to the overhead, when the tokenizer accepts ``tools``.

Templates where the sum is not exact (messages rendered differently in context, roles merged;
vLLM itself folds `developer` messages into the leading system message) are caught by
verification: when an estimate comes close to the budget the caller asks for one exact count of
the final list with `count_exact`, which records how far off the estimate was. Once an estimate
has been found *short*, the model is no longer trusted and "close" becomes a wide margin.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gateway.trimming.core import Message, leading_instructions

# tokenize(messages, add_generation_prompt) -> tokens; with tools, also a `tools=` keyword.
Tokenize = Callable[..., Awaitable[int]]

log = logging.getLogger("gateway.trimming")

# Probe conversation for calibration: ordinary, template-friendly messages.
_PROBES: tuple[Message, ...] = (
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


@dataclass(frozen=True)
class PromptCount:
    """The token count of one prompt: per message, plus a fixed overhead.

    `unseen` lists the messages whose entry in `per_message` is only an upper bound (see
    `TokenCounter.estimate_cached`); empty for a count from `TokenCounter.count`.
    """

    per_message: list[int]
    overhead: int
    unseen: list[Message] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.overhead + sum(self.per_message)


Key = Hashable


def message_key(message: Message) -> Key:
    """A content hash of the message: equal for equal messages, whatever their key order.

    The common ``{"role", "content": str}`` message is keyed by its role, length and Python's
    string hash (SipHash, keyed per process); anything else by a BLAKE2 hash of its canonical JSON.
    """
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str) and isinstance(message.get("role"), str):
        return (message["role"], len(content), hash(content))
    canonical = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def _payload_bytes(message: Message) -> int:
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str):
        return len(content.encode()) + len(str(message.get("role", "")))
    return len(json.dumps(message, ensure_ascii=False).encode())


class TokenCounter:
    """Counts chat prompts in the tokens of each model's own template, remembering each message.

    One counter serves all models (keys include the model name). `max_entries` bounds the cache;
    `concurrency` bounds the tokenize calls made at once for one request's unseen messages;
    `max_calls` bounds how many new messages one request (or one background task) tokenizes;
    `verify_margin` is how close to the budget an estimate may come before it is verified.
    """

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        concurrency: int = 8,
        verify_margin: int = 8,
        max_background: int = 64,
        max_calls: int = 256,
    ) -> None:
        if max_entries < 1 or concurrency < 1 or verify_margin < 0 or max_calls < 1:
            raise ValueError("max_entries, concurrency and max_calls must be >= 1, verify_margin >= 0")
        self.max_entries = max_entries
        self.concurrency = concurrency
        self.verify_margin = verify_margin
        self.max_calls = max_calls
        # Counting tasks in flight; beyond that, new messages wait for the next turn.
        self.max_background = max_background
        self._cache: OrderedDict[tuple[str, Key], int] = OrderedDict()  # also tool lists' costs
        self._calibrations: dict[str, Calibration] = {}
        self._learning: set[tuple[str, Key]] = set()  # being counted right now
        self._background: set[asyncio.Task[None]] = set()

    def calibration(self, model: str) -> Calibration | None:
        return self._calibrations.get(model)

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def counting_in_background(self) -> int:
        """Background tasks still counting new messages (see `learn_later`)."""
        return len(self._background)

    async def estimate(
        self,
        model: str,
        tokenize: Tokenize,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        budget: int,
        tools: list[Any] | None = None,
    ) -> PromptCount:
        """The cheapest count that can decide whether `messages` fit `budget`.

        From the cache alone when that is exact, or when the prompt fits `budget` even with the
        upper bounds of its unseen messages (listed in `unseen`: they are then counted in the
        background, for the next turn, and the request need not wait); otherwise counted, with
        only the messages not seen before tokenized, at most `max_calls` of them (see `count`).
        """
        quick = self.estimate_cached(model, messages, add_generation_prompt, tools)
        if quick is not None and not quick.unseen:
            return quick
        if quick is not None and not self.needs_verification(model, quick.total, budget):
            self.learn_later(model, tokenize, quick.unseen)
            return quick
        return await self.count(model, tokenize, messages, add_generation_prompt, tools, budget=budget)

    async def verify(
        self,
        model: str,
        tokenize: Tokenize,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        estimate: int,
        budget: int,
        tools: list[Any] | None = None,
    ) -> int:
        """The prompt tokens of `messages`: `estimate` when it is safely under `budget`, else
        one exact count (which teaches the counter how far off the estimate was)."""
        if not self.needs_verification(model, estimate, budget):
            return estimate
        return await self.count_exact(model, tokenize, messages, add_generation_prompt, estimate=estimate, tools=tools)

    def learn_later(self, model: str, tokenize: Tokenize, messages: Sequence[Message]) -> None:
        """Count `messages` in a background task (at most `max_background` at once)."""
        if len(self._background) >= self.max_background:
            return
        task = asyncio.create_task(self._learn_quietly(model, tokenize, list(messages)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _learn_quietly(self, model: str, tokenize: Tokenize, messages: list[Message]) -> None:
        try:
            await self.learn(model, tokenize, messages)
        except Exception as exc:  # noqa: BLE001 - the next request counts them again
            log.debug("background token count for model %s failed: %r", model, exc)

    def estimate_cached(
        self,
        model: str,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
    ) -> PromptCount | None:
        """A count from the cache alone, no tokenize call: exact for the messages seen before,
        an upper bound for the others (listed in `unseen`). None before the model is calibrated
        or while the tools' cost is unknown."""
        calibration = self._calibrations.get(model)
        if calibration is None:
            return None
        overhead = calibration.per_call + (calibration.generation_prompt if add_generation_prompt else 0)
        if tools:
            cost = self._cache.get((model, _tools_key(tools)))
            if cost is None:
                return None
            overhead += cost
        cache = self._cache
        per_message: list[int] = []
        unseen: list[Message] = []
        for message in messages:
            key = (model, message_key(message))
            value = cache.get(key)
            if value is None:
                unseen.append(message)
                value = upper_bound(message, calibration)
            else:
                cache.move_to_end(key)
            per_message.append(value)
        return PromptCount(per_message=per_message, overhead=overhead, unseen=unseen)

    async def learn(self, model: str, tokenize: Tokenize, messages: Sequence[Message]) -> None:
        """Count and cache `messages` (meant for a background task: the request did not wait)."""
        keys = {(model, message_key(m)): m for m in messages}
        fresh = {k: m for k, m in keys.items() if k not in self._cache and k not in self._learning}
        self._learning.update(fresh)
        try:
            await self.count(model, tokenize, list(fresh.values()), False)
        finally:
            self._learning.difference_update(fresh)

    async def count(
        self,
        model: str,
        tokenize: Tokenize,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        *,
        budget: int | None = None,
    ) -> PromptCount:
        """Estimate the prompt of `messages`, tokenizing at most `max_calls` messages not seen before.

        Which ones: the leading system/developer messages, then the newest backwards, as long as
        a message could still be part of a prompt within `budget` (no limit without one). The
        other new messages get an upper bound from their size and are listed in `unseen`.
        With `tools`, `tokenize` must accept them as ``tools=``; their cost joins the overhead.
        """
        calibration = await self._calibrate(model, tokenize)
        overhead = calibration.per_call + (calibration.generation_prompt if add_generation_prompt else 0)
        if tools:
            overhead += await self._tools_cost(model, tokenize, tools)
        keys = [(model, message_key(m)) for m in messages]
        chosen = self._choose(keys, messages, calibration, overhead, budget)
        fresh: dict[tuple[str, Key], int] = {}
        pending = list(chosen.items())
        for start in range(0, len(pending), self.concurrency):
            batch = pending[start : start + self.concurrency]
            counts = await asyncio.gather(*(tokenize([m], False) for _, m in batch))
            for (key, _), raw in zip(batch, counts, strict=True):
                fresh[key] = max(0, raw - calibration.per_call)
        known: list[int | None] = []
        for key in keys:
            value = fresh.pop(key, None)
            if value is not None:
                self._remember(key, value)  # in the conversation's order: the newest is the most recent
            else:
                value = self._cache.get(key)
            known.append(value)
        per_message = self._fill(messages, known, calibration, overhead, budget)
        unseen = [message for message, value in zip(messages, known, strict=True) if value is None]
        return PromptCount(per_message=per_message, overhead=overhead, unseen=unseen)

    def _fill(
        self,
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
        floor = max(1, calibration.empty_message // 2)
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
        counted_bytes = sum(_payload_bytes(message) for message, _ in counted)
        per_byte = sum(value for _, value in counted) / counted_bytes if counted_bytes else None
        out: list[int] = []
        for index, (message, value) in enumerate(zip(messages, known, strict=True)):
            if value is None:
                if head <= index < beyond and per_byte is not None:
                    value = max(floor, round(_payload_bytes(message) * per_byte))
                else:
                    value = upper_bound(message, calibration)
            out.append(value)
        return out

    def _choose(
        self,
        keys: list[tuple[str, Key]],
        messages: Sequence[Message],
        calibration: Calibration,
        overhead: int,
        budget: int | None,
    ) -> dict[tuple[str, Key], Message]:
        """The new messages `count` tokenizes (at most `max_calls`), in the order of `count`'s doc.

        Walks the instructions, then the conversation from its newest message back, adding what
        each message costs at least (its cached count, else `floor`); it stops at `max_calls`
        new messages or where even those least costs pass `budget`, since an older message can
        then not be in any prompt that fits (the newest message is counted whatever its cost: it
        is always sent). Messages found in the cache are marked recently used.
        """
        cache = self._cache
        floor = max(1, calibration.empty_message // 2)
        head = leading_instructions(messages)
        order = itertools.chain(range(head), range(len(messages) - 1, head - 1, -1))
        chosen: dict[tuple[str, Key], Message] = {}
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
            if len(chosen) >= self.max_calls or not could_fit:
                break
            chosen[key] = messages[index]
        return chosen

    def needs_verification(self, model: str, estimate: int, budget: int) -> bool:
        """Whether an estimate is close enough to the budget that only an exact count will do."""
        calibration = self._calibrations.get(model)
        if calibration is None:
            return True
        if calibration.trusted:
            slack = self.verify_margin
        else:
            slack = max(4 * self.verify_margin, 4 * calibration.max_short, budget // 4)
        return estimate > budget - slack

    async def count_exact(
        self,
        model: str,
        tokenize: Tokenize,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        estimate: int | None = None,
        tools: list[Any] | None = None,
    ) -> int:
        """One tokenize call of the whole prompt; learns how far `estimate` was off."""
        if tools:
            exact = await tokenize(list(messages), add_generation_prompt, tools=tools)
        else:
            exact = await tokenize(list(messages), add_generation_prompt)
        calibration = self._calibrations.get(model)
        if calibration is not None and estimate is not None and exact > estimate:
            calibration.max_short = max(calibration.max_short, exact - estimate)
            calibration.trusted = False
        return exact

    async def _calibrate(self, model: str, tokenize: Tokenize) -> Calibration:
        known = self._calibrations.get(model)
        if known is not None:
            return known
        a, b, c = _PROBES
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
        calibration = Calibration(
            per_call=per_call,
            generation_prompt=max(0, cabc_gen - cabc),
            empty_message=max(0, empty - per_call),
            trusted=cabc <= estimate and ca + cb - cab >= 0,
            max_short=max(0, cabc - estimate),
        )
        self._calibrations[model] = calibration
        return calibration

    async def _tools_cost(self, model: str, tokenize: Tokenize, tools: list[Any]) -> int:
        key = (model, _tools_key(tools))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        probe = [_PROBES[1]]
        with_tools, without = await asyncio.gather(
            tokenize(probe, False, tools=tools),
            tokenize(probe, False),
        )
        cost = max(0, with_tools - without)
        self._remember(key, cost)
        return cost

    def _remember(self, key: tuple[str, Key], value: int) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)


def upper_bound(message: Message, calibration: Calibration) -> int:
    """What a message not counted yet is taken to cost: more than any tokenizer that spends at most
    one token per UTF-8 byte (byte-level BPE, byte fallback) renders it in, template included."""
    return 2 * _payload_bytes(message) + calibration.empty_message + 16


def _tools_key(tools: list[Any]) -> bytes:
    canonical = json.dumps(tools, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return b"tools:" + hashlib.blake2b(canonical.encode(), digest_size=16).digest()
