"""The engines behind the gateway, by served model, and the one step that gives a request a replica.

`EnginePool` holds every served model's `ModelPool`: its replicas (`Engine`s) and what the gateway
knows about the model (trimming settings, context length, its /v1/models card), and the prefix
indexes every model shares (`CacheState`, cache.py). State only; the one I/O is reading a prompt
for routing (`ModelPool.prompt`, which may ask an engine's /tokenize). Taking a replica
(`ModelPool.route`, or `acquire` for the replica alone) is the routing decision, the
outstanding-request increment and the record of where the prompt went, in one synchronous step,
so two requests arriving together cannot both see an idle engine (there is no `await` in between).
The pool also keeps each replica's requests in flight (service.py: when each was sent and how many
prompt tokens it computes), so the scorer can weigh the work a request would wait behind against
what a replica's cache saves it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from server.config import ServedModel, TrimmingConfig
from server.gateway.errors import ModelNotFound
from server.gateway.replicas import routing
from server.gateway.replicas.cache import CacheState, PromptView
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.scoring import Decision, choose_scored
from server.gateway.replicas.service import InFlight, PrefillCost
from server.gateway.settings import Routing


@dataclass(eq=False)
class ModelPool:
    """The replicas of one served model, and what the gateway knows about that model."""

    name: str
    engines: list[Engine]
    trimming: TrimmingConfig = field(default_factory=lambda: TrimmingConfig(mode="off"))
    configured_max_model_len: int | None = None  # from the profile, until an engine reports its own
    configured_block_size: int | None = None  # from the profile, until the engines say theirs
    cache: CacheState = field(default_factory=CacheState)  # the prefix indexes (EnginePool shares one)
    _turn: int = field(default=0, init=False, repr=False)
    # The engine ids of the last cache_aware decisions, for the split guard (Routing.share_window).
    _recent: deque[str] = field(default_factory=deque, init=False, repr=False)
    # Each replica's requests in flight, by engine id (service.py), timed by `clock` (seconds).
    _inflight: dict[str, InFlight] = field(default_factory=dict, init=False, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)

    @property
    def max_model_len(self) -> int | None:
        """The smallest context any replica reports (requests must fit every replica)."""
        reported = [e.max_model_len for e in self.engines if e.max_model_len is not None]
        return min(reported) if reported else self.configured_max_model_len

    @property
    def has_choice(self) -> bool:
        """More than one replica: routing has something to choose. With one, a request needs no
        affinity key and no prompt blocks (and the decision is that replica)."""
        return len(self.engines) > 1

    @property
    def healthy_count(self) -> int:
        return sum(1 for e in self.engines if e.healthy)

    def acquire(self, policy: Routing, *, key: bytes | None = None, exclude: Iterable[Engine] = ()) -> Engine | None:
        """Choose a replica and count the request against it; None if no healthy one is left."""
        decision = self.route(policy, key=key, exclude=exclude)
        return decision.engine if decision is not None else None

    async def prompt(
        self, policy: Routing, body: Mapping[str, Any], *, adapter: str | None = None
    ) -> PromptView | None:
        """The request's prompt in blocks, for `route` (None unless the policy is cache_aware and the
        model has more than one replica: with one, there is nothing for the prompt to decide)."""
        if policy.policy != "cache_aware" or not self.has_choice:
            return None
        return await self.cache.read(
            self.name, body, self.engines, precise=policy.prefix_index == "precise", adapter=adapter
        )

    def route(
        self,
        policy: Routing,
        *,
        key: bytes | None = None,
        prompt: PromptView | None = None,
        exclude: Iterable[Engine] = (),
    ) -> Decision | None:
        """Choose a replica, count the request against it and say why; None if no healthy one is left."""
        self._turn += 1
        exclude = tuple(exclude)
        if policy.policy != "cache_aware":
            chosen = routing.choose_with_reason(
                self.engines,
                key=key,
                max_imbalance=policy.max_imbalance,
                turn=self._turn,
                policy=policy.policy,
                exclude=exclude,
            )
            if chosen is None:
                return None
            chosen[0].outstanding += 1
            self._inflight_of(chosen[0]).sent(self.clock(), 0)
            return Decision(chosen[0], chosen[1], policy.policy)
        live = [e for e in self.engines if e.healthy and e not in exclude]
        if not live:
            return None
        now = time.monotonic()
        if len(live) == 1:  # nothing to choose: no prefix matching, no scores (the log says `only_choice`)
            engine = live[0]
            engine.outstanding += 1
            self._inflight_of(engine).sent(self.clock(), 0)
            self.cache.sent(engine, prompt, now, configured_block_size=self.configured_block_size)
            self._remember(engine, policy.share_window)
            return Decision(engine, "only_choice", "cache_aware")
        precise = policy.prefix_index == "precise"
        source, blocks, candidates = self.cache.candidates(
            live, prompt, now, precise=precise, configured_block_size=self.configured_block_size
        )
        hot = self.cache.hot_blocks(live, prompt, source, configured_block_size=self.configured_block_size)
        recent = Counter(self._recent)
        clock = self.clock()
        per_block = {
            e.id: self.cache.tokens_per_block(e, source, configured_block_size=self.configured_block_size) for e in live
        }
        costs = {e.id: PrefillCost.of(e.metrics) for e in live}
        candidates = [
            dataclasses.replace(
                c,
                recent=recent.get(c.engine.id, 0),
                wait=self._inflight_of(c.engine).left(costs[c.engine.id], clock),
                block_seconds=_block_seconds(costs[c.engine.id], per_block[c.engine.id]),
            )
            for c in candidates
        ]
        preferred = routing.rendezvous_order(key, live)[0] if routing.is_session_key(key) and key else None
        decision = choose_scored(
            candidates,
            weights=policy.weights_for(self.name),
            prompt_blocks=blocks,
            preferred=preferred,
            max_imbalance=policy.max_imbalance,
            turn=self._turn,
            source=source,
            hot_blocks=hot,
            window=len(self._recent),
            max_split=policy.max_split,
        )
        assert decision is not None  # `live` is not empty
        engine = decision.engine
        engine.outstanding += 1
        matched = next(c.matched for c in decision.candidates if c.engine is engine)
        self._inflight_of(engine).sent(clock, max(0, blocks - matched) * per_block[engine.id])
        self.cache.sent(decision.engine, prompt, now, configured_block_size=self.configured_block_size)
        self._remember(decision.engine, policy.share_window)
        return decision

    def _remember(self, engine: Engine, window: int) -> None:
        """`engine` took a request: the split guard's window of the last `window` decisions."""
        self._recent.append(engine.id)
        while len(self._recent) > window:
            self._recent.popleft()

    def side_engine(self) -> Engine | None:
        """An engine for a side request of the gateway's own (trimming's /tokenize): the least loaded
        healthy one. No routing decision: round robin's turn does not move and nothing is counted."""
        live = [e for e in self.engines if e.healthy]
        return min(live, key=lambda e: e.outstanding) if live else None

    def release(self, engine: Engine) -> None:
        """The request `acquire` counted against `engine` is over."""
        engine.outstanding -= 1
        self._inflight_of(engine).ended()

    def _inflight_of(self, engine: Engine) -> InFlight:
        inflight = self._inflight.get(engine.id)
        if inflight is None:
            inflight = self._inflight[engine.id] = InFlight()
        return inflight

    def card(self) -> dict[str, object]:
        """The model's /v1/models entry: an engine's own card when one has reported it."""
        for engine in self.engines:
            if engine.card is not None:
                return dict(engine.card)
        return {
            "id": self.name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "max_model_len": self.max_model_len,
        }


class EnginePool:
    """Every served model's replicas, by model name."""

    def __init__(self, models: Iterable[ModelPool], *, cache: CacheState | None = None) -> None:
        self.models: dict[str, ModelPool] = {}
        self.cache = cache if cache is not None else CacheState()
        for pool in models:
            pool.cache = self.cache
            if pool.name in self.models:
                self.models[pool.name].engines.extend(pool.engines)
            else:
                self.models[pool.name] = pool

    @classmethod
    def from_models(cls, models: Iterable[ServedModel], *, cache: CacheState | None = None) -> EnginePool:
        """One `Engine` per URL of each served model, with what its profile says."""
        pools = []
        for model in models:
            planned = model.planned_kv_tokens
            pools.append(
                ModelPool(
                    name=model.name,
                    engines=[Engine(model.name, url, planned_kv_tokens=planned) for url in model.urls],
                    trimming=model.trimming,
                    configured_max_model_len=model.max_model_len,
                    configured_block_size=model.block_size,
                )
            )
        return cls(pools, cache=cache)

    def get(self, name: str) -> ModelPool:
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(name, self.models) from None

    def engines(self) -> Iterator[Engine]:
        for pool in self.models.values():
            yield from pool.engines

    def ready(self) -> bool:
        """At least one healthy replica for every model."""
        return bool(self.models) and all(pool.healthy_count for pool in self.models.values())


def _block_seconds(cost: PrefillCost | None, tokens_per_block: float) -> float:
    """Seconds computing one prompt block takes an engine (0 while its cost is unknown)."""
    return cost.per_token * tokens_per_block if cost is not None else 0.0
