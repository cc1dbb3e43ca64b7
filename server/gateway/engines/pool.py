"""The engines behind the gateway: per served model, its replicas and what is known about them.

State only, no I/O: the health checker writes health and model cards, the proxy takes and
gives back outstanding-request slots, routing reads both. Taking a slot is the routing
decision and the counter increment in one synchronous step, so two requests arriving
together cannot both see an idle engine (there is no `await` in between).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from server.gateway.engines import routing
from server.gateway.errors import ModelNotFound
from server.gateway.settings import ResolvedModel, Routing
from server.engine.profiles import Profile, TrimmingConfig


class Engine:
    """One engine replica: where it is, whether it is up, how busy it is, what it serves."""

    __slots__ = ("id", "url", "model", "healthy", "checked", "outstanding", "failures", "successes",
                 "card", "last_error", "last_change")

    def __init__(self, model: str, url: str) -> None:
        self.model = model
        self.url = url.rstrip("/")
        self.id = urlsplit(self.url).netloc or self.url
        self.healthy = True  # until the first check says otherwise
        self.checked = False
        self.outstanding = 0
        self.failures = 0
        self.successes = 0
        self.card: dict[str, Any] | None = None  # this model's entry in the engine's /v1/models
        self.last_error: str | None = None
        self.last_change = time.monotonic()

    def __repr__(self) -> str:
        state = "up" if self.healthy else "down"
        return f"<Engine {self.model}@{self.id} {state} outstanding={self.outstanding}>"

    @property
    def max_model_len(self) -> int | None:
        value = self.card.get("max_model_len") if self.card else None
        return value if isinstance(value, int) else None

    def record_check(self, ok: bool, *, unhealthy_after: int, healthy_after: int, error: str | None = None) -> bool:
        """Count one health-check result; True when the engine's state changed."""
        before = self.healthy
        if ok:
            self.failures = 0
            self.successes += 1
            self.last_error = None
            if not self.checked or self.successes >= healthy_after:
                self.healthy = True
        else:
            self.successes = 0
            self.failures += 1
            self.last_error = error
            if not self.checked or self.failures >= unhealthy_after:
                self.healthy = False
        self.checked = True
        if self.healthy != before:
            self.last_change = time.monotonic()
            return True
        return False

    def mark_down(self, error: str) -> None:
        """A request could not even connect: stop sending traffic until a health check passes."""
        if self.healthy:
            self.last_change = time.monotonic()
        self.healthy = False
        self.successes = 0
        self.last_error = error


@dataclass
class ModelPool:
    """The replicas of one served model, and what the gateway knows about that model."""

    name: str
    engines: list[Engine]
    trimming: TrimmingConfig = field(default_factory=lambda: TrimmingConfig(mode="off"))
    configured_max_model_len: int | None = None  # from the profile, until an engine reports its own
    planned_kv_tokens: int | None = None
    _turn: int = 0

    @property
    def max_model_len(self) -> int | None:
        """The smallest context any replica reports (requests must fit every replica)."""
        reported = [e.max_model_len for e in self.engines if e.max_model_len is not None]
        return min(reported) if reported else self.configured_max_model_len

    @property
    def healthy_count(self) -> int:
        return sum(1 for e in self.engines if e.healthy)

    def acquire(self, policy: Routing, *, key: bytes | None = None,
                exclude: Iterable[Engine] = ()) -> Engine | None:
        """Choose a replica and count the request against it; None if no healthy one is left."""
        self._turn += 1
        engine = routing.choose(self.engines, key=key, max_imbalance=policy.max_imbalance, turn=self._turn,
                                policy=policy.policy, exclude=tuple(exclude))
        if engine is not None:
            engine.outstanding += 1
        return engine

    @staticmethod
    def release(engine: Engine) -> None:
        engine.outstanding -= 1

    def card(self) -> dict[str, Any]:
        """The model's /v1/models entry: an engine's own card when one has reported it."""
        for engine in self.engines:
            if engine.card is not None:
                return dict(engine.card)
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "vllm",
                "max_model_len": self.max_model_len}


class Upstreams:
    """All served models by name."""

    def __init__(self, pools: Iterable[ModelPool]) -> None:
        self.models: dict[str, ModelPool] = {}
        for pool in pools:
            if pool.name in self.models:
                self.models[pool.name].engines.extend(pool.engines)
            else:
                self.models[pool.name] = pool

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


def planned_kv_tokens(profile: Profile) -> int | None:
    """The KV-cache capacity the planner expects for one engine of `profile`, when it can tell."""
    from server.engine.planner import plan_profile

    try:
        return plan_profile(profile).kv_cache_tokens
    except Exception:  # noqa: BLE001 - a plan is a nice-to-have here (GPU profiles need --device-memory)
        return None


def build_upstreams(models: Iterable[ResolvedModel]) -> Upstreams:
    return Upstreams(
        ModelPool(
            name=model.name,
            engines=[Engine(model.name, url) for url in model.urls],
            trimming=model.trimming,
            configured_max_model_len=model.profile.max_model_len if model.profile else None,
            planned_kv_tokens=planned_kv_tokens(model.profile) if model.profile else None,
        )
        for model in models
    )
