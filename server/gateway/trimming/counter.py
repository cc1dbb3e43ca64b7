"""Exact prompt token counts from the engine's own tokenizer and chat template, cached per message.

The engine is asked through an injected `tokenize(messages, add_generation_prompt) -> int`
(vLLM's ``/tokenize`` with ``messages``); this module does no HTTP itself.

How a count is made cheap. Once per model the counter measures what the template adds around
the messages (`calibration.calibrate`: ``per_call``, ``generation_prompt``, ``empty_message``,
``trusted``). Each message is then tokenized alone, once: its net count ``c([m]) - per_call`` is
cached under a hash of its content (`keys.message_key`, in a bounded LRU), so a conversation that
grows by one message costs one small tokenize call. The estimate of a whole prompt is
``per_call + sum(net) + generation_prompt``, plus the cost of the request's tool list
(`calibration.tools_cost`, cached per distinct list) when it has one.

The work per request is bounded (`selection`): at most `max_calls` new messages are tokenized
for one request, and only those that could still be part of a prompt within the budget; every
other new message is estimated from its size and listed in `unseen`. One request thus makes at
most 7 (calibration, once per model) + 2 (a new tool list) + `max_calls` + the verification
rounds calls, and adds at most `max_calls` entries to the shared cache, so it cannot flush it.

Not even that call is waited for when it cannot matter: `estimate_cached` answers from the cache
alone, with a generous upper bound (`selection.upper_bound`: twice the message's UTF-8 bytes,
plus the template's cost of an empty message) for messages not seen yet. If the prompt fits its
budget even so, the caller sends it at once and lets `learn` count the new messages in the
background for the next turn.

Templates where the sum is not exact (messages rendered differently in context, roles merged;
vLLM itself folds `developer` messages into the leading system message) are caught by
verification: when an estimate comes close to the budget the caller asks for one exact count of
the final list with `count_exact`, which records how far off the estimate was. Once an estimate
has been found *short*, the model is no longer trusted and "close" becomes a wide margin.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gateway.trimming.calibration import Calibration, Tokenize, calibrate, tools_cost
from server.gateway.trimming.core import Message
from server.gateway.trimming.keys import message_key, tools_key
from server.gateway.trimming.selection import CacheKey, choose, fill, upper_bound

log = logging.getLogger("gateway.trimming")


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
        self._cache: OrderedDict[CacheKey, int] = OrderedDict()  # also tool lists' costs
        self._calibrations: dict[str, Calibration] = {}
        self._learning: set[CacheKey] = set()  # being counted right now
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
            cost = self._cache.get((model, tools_key(tools)))
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
        chosen = choose(keys, messages, self._cache, calibration, overhead, budget, self.max_calls)
        fresh: dict[CacheKey, int] = {}
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
        per_message = fill(messages, known, calibration, overhead, budget)
        unseen = [message for message, value in zip(messages, known, strict=True) if value is None]
        return PromptCount(per_message=per_message, overhead=overhead, unseen=unseen)

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
        calibration = await calibrate(tokenize)
        self._calibrations[model] = calibration
        return calibration

    async def _tools_cost(self, model: str, tokenize: Tokenize, tools: list[Any]) -> int:
        key = (model, tools_key(tools))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        cost = await tools_cost(tokenize, tools)
        self._remember(key, cost)
        return cost

    def _remember(self, key: CacheKey, value: int) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
