"""Where each replica's prefix cache is, as routing needs it: a prompt's blocks, and each
replica's match, from the precise index when every candidate's events are live, else from the
approximate one.

`PromptView` is one request's prompt, cut into blocks: text blocks always (the approximate
index), token blocks when the engine's /tokenize gave its token ids (the precise index, in each
engine's block size). `CacheState` holds the two indexes of the gateway (keyed by engine id, so
one of each serves every model) and the tokenizer; `candidates` scores nothing, it only says what
each replica holds of the prompt; `sent` records where the prompt went (the approximate record,
and the precise index's speculative entries).

Why text for the approximate index: it needs no tokenizer and no extra round trip, so it works in
front of any engine; the text blocks do not line up with the engine's token blocks, but the
approximate index only compares prompts with the prompts the gateway itself sent. Why /tokenize
for the precise one: vLLM's own chat template and tokenizer, exactly what the engine prefills;
one small request to an engine per new way a chat opens (its leading messages, remembered in
tokens.py) or per single-message prompt, only while precise routing can use it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gateway.replicas.approximate import ApproximateIndex
from server.gateway.replicas.blocks import (
    BlockKey,
    prompt_text,
    request_namespace,
    text_blocks,
    token_blocks,
)
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.precise import PreciseIndex
from server.gateway.replicas.scoring import Candidate
from server.gateway.replicas.tokenizer import Tokenize

log = logging.getLogger("gateway.routing")

# Characters per token assumed when sizing an approximate record from an engine's cache in tokens,
# until the engine's own counters say better: high for most tokenizers, so the record holds at least
# what the engine can. Learned per engine (`_CharsPerToken`) between 1 and this.
CHARS_PER_TOKEN = 4
LEARN_AFTER_TOKENS = 4096  # prompt tokens an engine must count before a ratio is learned from them
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPU, when neither events, metrics nor profile say
TRAFFIC_WINDOW = 64  # recent prompts whose blocks say which prefix is hot (PrefixTraffic)
EVICTING_SECONDS = 10.0  # an engine that sent a BlockRemoved this recently is evicting


@dataclass
class PromptView:
    """One request's prompt, cut into blocks for the prefix indexes."""

    text_keys: list[BlockKey]
    chars: int = 0  # the prompt text's length (what the text blocks cover)
    tokens: list[int] | None = None  # the engine's token ids, when /tokenize answered
    namespace: str = ""  # blocks.namespace: its LoRA adapter and cache_salt ("" for neither)
    _token_keys: dict[int, list[BlockKey]] = field(default_factory=dict, repr=False)

    def token_keys(self, block_size: int) -> list[BlockKey]:
        keys = self._token_keys.get(block_size)
        if keys is None:
            keys = self._token_keys[block_size] = token_blocks(self.tokens or (), block_size, namespace=self.namespace)
        return keys


class CacheState:
    """The gateway's two prefix indexes, and how a prompt is read and matched against them."""

    def __init__(
        self,
        *,
        approximate: ApproximateIndex | None = None,
        precise: PreciseIndex | None = None,
        tokenize: Tokenize | None = None,
        block_chars: int = 256,
    ) -> None:
        self.approximate = approximate if approximate is not None else ApproximateIndex()
        self.precise = precise if precise is not None else PreciseIndex()
        self.tokenize = tokenize
        self.block_chars = block_chars
        self._capacity: dict[str, tuple[float, float]] = {}  # engine id -> (KV tokens, chars per token) sized for
        self._ratios: dict[str, _CharsPerToken] = {}
        self.traffic = PrefixTraffic()
        self._removals: dict[str, tuple[int, float]] = {}  # engine id -> (its BlockRemoved count, when it last grew)
        self._measuring: dict[str, asyncio.Task[None]] = {}  # engine id -> its characters per token, being measured

    def precise_ready(self, engines: Sequence[Engine]) -> bool:
        """Every one of `engines` has live KV events."""
        return bool(engines) and all(self.precise.is_live(e.id) for e in engines)

    async def read(
        self,
        model: str,
        body: Mapping[str, Any],
        engines: Sequence[Engine],
        *,
        precise: bool,
        adapter: str | None = None,
    ) -> PromptView | None:
        """`body`'s prompt in blocks; tokenized by one of `engines` when precise routing can use it."""
        text = prompt_text(body)
        if text is None:
            return None
        namespace = request_namespace(adapter or "", body)  # the adapter and the tenant's cache_salt
        view = PromptView(text_blocks(text, self.block_chars, namespace=namespace), len(text), namespace=namespace)
        live = [e for e in engines if e.healthy]
        if not precise and self.tokenize is not None:  # (precise: the counter sizes its fallback record)
            for engine in live:
                if engine.id not in self._measuring and not self._ratio(engine).measured:
                    task = asyncio.create_task(self._measure(model, engine, body, len(text)))
                    self._measuring[engine.id] = task
        if precise and self.tokenize is not None and len(live) > 1 and self.precise_ready(live):
            view.tokens = await self.tokenize(model, sorted(live, key=lambda e: e.outstanding), body)
        return view

    async def _measure(self, model: str, engine: Engine, body: Mapping[str, Any], chars: int) -> None:
        """An engine's characters per token from one prompt, tokenized in the background once: the
        approximate record is sized by it from the first requests on, not from the engine's counter
        two scrapes later (5 s and more; a whole phase of the routing experiment on a quiet machine,
        which ran on the first guess of 4 and held twice what the tiny model's cache held)."""
        assert self.tokenize is not None
        try:
            tokens = await self.tokenize(model, [engine], body, True)
        except Exception as exc:  # nobody awaits this task: a closed client must not leave its error unread
            log.info("engine %s: /tokenize to size the approximate record failed (%r)", engine.id, exc)
            tokens = None
        if tokens:
            self._ratio(engine).measure(chars / len(tokens))
        else:
            del self._measuring[engine.id]  # try again with a later prompt

    async def aclose(self) -> None:
        """Cancel the background measurements still running (the gateway is stopping)."""
        tasks = [t for t in self._measuring.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def block_size(self, engine: Engine, configured: int | None) -> int:
        """The engine's KV block size: from its events, its metrics, its profile, or vLLM's default."""
        return self.precise.block_size(engine.id) or engine.metrics.block_size or configured or DEFAULT_BLOCK_SIZE

    def candidates(
        self,
        engines: Sequence[Engine],
        prompt: PromptView | None,
        now: float,
        *,
        precise: bool,
        configured_block_size: int | None = None,
    ) -> tuple[str, int, list[Candidate]]:
        """(source, prompt blocks, one candidate per engine) for scoring."""
        if prompt is None:
            return "none", 0, [Candidate(e) for e in engines]
        if precise and prompt.tokens is not None and self.precise_ready(engines):
            out = []
            blocks = 0
            for engine in engines:
                size = self.block_size(engine, configured_block_size)
                keys = prompt.token_keys(size)
                blocks = max(blocks, len(keys))
                held = self.precise.held(engine.id)
                pressure = self._pressure(engine, held, self._capacity_blocks(engine, size), now)
                out.append(Candidate(engine, self.precise.matched(engine.id, keys, now), held, pressure))
            return "precise", blocks, out
        keys = prompt.text_keys
        out = []
        for engine in engines:
            held = self.approximate.held(engine.id)
            capacity = self.approximate.capacity(engine.id)
            pressure = max(held / capacity if capacity else 0.0, _usage(engine))
            out.append(Candidate(engine, self.approximate.matched(engine.id, keys, now), held, min(1.0, pressure)))
        return "approximate", len(keys), out

    def tokens_per_block(self, engine: Engine, source: str, configured_block_size: int | None = None) -> float:
        """Prompt tokens in one of `source`'s blocks on `engine`: its KV block size (precise), or a text
        block's characters at the engine's learned characters per token (approximate)."""
        if source == "precise":
            return float(self.block_size(engine, configured_block_size))
        if source == "approximate":
            return self.block_chars / self._ratio(engine).value
        return 0.0

    def hot_blocks(
        self,
        engines: Sequence[Engine],
        prompt: PromptView | None,
        source: str,
        *,
        configured_block_size: int | None = None,
    ) -> int:
        """How many of the prompt's leading blocks (in `source`'s blocks) are a hot shared prefix."""
        if prompt is None or source == "none" or not engines:
            return 0
        if source == "precise":
            keys = prompt.token_keys(self.block_size(engines[0], configured_block_size))
        else:
            keys = prompt.text_keys
        return self.traffic.hot(keys, len(engines))

    def _capacity_blocks(self, engine: Engine, block_size: int) -> float:
        tokens = engine.metrics.kv_capacity_tokens or engine.planned_kv_tokens
        return tokens / block_size if tokens and block_size > 0 else 0.0

    def _pressure(self, engine: Engine, held: int, capacity: float, now: float) -> float:
        """0..1: the cache's fullness (blocks held over capacity, or KV usage), 1 while it evicts."""
        removed = self.precise.state(engine.id).removed
        count, grew = self._removals.get(engine.id, (0, float("-inf")))
        if removed > count:
            count, grew = removed, now
        elif removed < count:  # the index was rebuilt
            count = removed
        self._removals[engine.id] = (count, grew)
        if now - grew < EVICTING_SECONDS:
            return 1.0
        return min(1.0, max(held / capacity if capacity else 0.0, _usage(engine)))

    def sent(
        self, engine: Engine, prompt: PromptView | None, now: float, *, configured_block_size: int | None = None
    ) -> None:
        """`prompt` was routed to `engine`: the approximate record, and speculative precise entries."""
        if prompt is None:
            return
        self._ratio(engine).chars += prompt.chars
        self._size_record(engine)
        self.approximate.record(engine.id, prompt.text_keys, now)
        keys = [prompt.text_keys]
        if prompt.tokens is not None:
            token_keys = prompt.token_keys(self.block_size(engine, configured_block_size))
            self.precise.speculate(engine.id, token_keys, now)
            keys.append(token_keys)
        self.traffic.add(keys)

    def _ratio(self, engine: Engine) -> _CharsPerToken:
        ratio = self._ratios.get(engine.id)
        if ratio is None:
            ratio = self._ratios[engine.id] = _CharsPerToken()
        return ratio

    def _size_record(self, engine: Engine) -> None:
        """The approximate record holds about what the engine's KV cache does: its capacity in
        tokens, in characters at the engine's learned characters per token, in text blocks."""
        tokens = engine.metrics.kv_capacity_tokens or engine.planned_kv_tokens
        ratio = self._ratio(engine).learn(engine.metrics.prefix_queries_tokens)
        if tokens and self._capacity.get(engine.id) != (tokens, ratio):
            self._capacity[engine.id] = (tokens, ratio)
            self.approximate.set_capacity(engine.id, int(tokens * ratio / self.block_chars))


def _usage(engine: Engine) -> float:
    usage = engine.metrics.kv_usage
    return 0.0 if usage is None else min(1.0, max(0.0, usage))


class PrefixTraffic:
    """Which blocks the recent prompts began with: a block that more than one replica's share of
    them carried (a company's house rules at the head of every tenant's system prompt) is a hot
    shared prefix. In a balanced split every replica serves some of those prompts, so every
    replica holds that prefix soon anyway: matching it does not tell replicas apart (scoring.py).

    The count of a block never exceeds its parent's (a prompt that carries a block carries every
    block before it), so the hot blocks of a prompt are always its leading ones."""

    def __init__(self, window: int = TRAFFIC_WINDOW) -> None:
        self.window = window
        self._prompts: deque[tuple[BlockKey, ...]] = deque()
        self._counts: Counter[BlockKey] = Counter()

    def add(self, key_lists: Sequence[Sequence[BlockKey]]) -> None:
        """One routed prompt's blocks (its text blocks and, when tokenized, its token blocks)."""
        keys = tuple(dict.fromkeys(k for keys in key_lists for k in keys))
        self._prompts.append(keys)
        self._counts.update(keys)
        while len(self._prompts) > self.window:
            for key in self._prompts.popleft():
                left = self._counts[key] - 1
                if left > 0:
                    self._counts[key] = left
                else:
                    del self._counts[key]

    def hot(self, keys: Sequence[BlockKey], replicas: int) -> int:
        """How many leading `keys` more than 1/`replicas` of the recent prompts carried (and at least 2)."""
        if replicas <= 1 or not self._prompts:
            return 0
        share = len(self._prompts) / replicas
        count = 0
        for key in keys:
            seen = self._counts.get(key, 0)
            if seen < 2 or seen <= share:
                break
            count += 1
        return count


@dataclass
class _CharsPerToken:
    """One engine's characters per prompt token, from the prompt text routed to it and the prompt
    tokens its prefix cache was asked about (`vllm:prefix_cache_queries`, scraped).

    The tiny model's tokenizer makes about 1.9 characters a token: sized at 4, the approximate
    record remembered twice what the engine's cache holds and kept routing to blocks long evicted.
    Tokens the engine counts for prompts this process did not route (other gateway workers or
    clients) lower the ratio, so the record errs small: it is kept between 1 and CHARS_PER_TOKEN.
    """

    value: float = CHARS_PER_TOKEN
    chars: int = 0  # prompt characters routed to the engine since `since` was read
    since: float | None = None  # the engine's counter when `chars` started
    measured: bool = False  # a prompt of this engine's was tokenized (CacheState._measure) or the counter spoke

    def measure(self, value: float) -> None:
        """One prompt's characters per token, until the engine's counter says better."""
        if not self.measured:
            self.value = min(CHARS_PER_TOKEN, max(1.0, value))
            self.measured = True

    def learn(self, counted: float | None) -> float:
        if counted is None:
            return self.value
        if self.since is None or counted < self.since:  # the first reading, or the engine restarted
            self.since, self.chars = counted, 0
            return self.value
        grown = counted - self.since
        if grown >= LEARN_AFTER_TOKENS and self.chars:
            self.value = min(CHARS_PER_TOKEN, max(1.0, self.chars / grown))
            self.since, self.chars, self.measured = counted, 0, True
        return self.value
