"""LoRA adapters: which replicas serve which adapter, for routing and for /v1/models.

An engine started with `--enable-lora` lists its adapters in `/v1/models` next to its base model,
each card with `parent` set (vLLM's `ModelCard.parent`). The health checker records them on the
engine (`Engine.adapters`, name -> card) whenever it reads the engine's cards; runtime loads and
unloads through the gateway (proxy.fanout) update them at once. A request whose `model` names an
adapter goes to the base model's pool, but only to the replicas that list the adapter
(`lacking` are excluded from the choice). Pure functions over `Engine`s; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from server.gateway.replicas.engine import Engine

if TYPE_CHECKING:
    from server.gateway.replicas.pool import EnginePool, ModelPool


def adapter_cards(cards: Iterable[Any], base: str) -> dict[str, dict[str, Any]]:
    """The adapters among an engine's /v1/models cards (those with a `parent`), by name."""
    found: dict[str, dict[str, Any]] = {}
    for card in cards:
        if (
            isinstance(card, dict)
            and isinstance(name := card.get("id"), str)
            and name != base
            and card.get("parent") is not None
        ):
            found[name] = card
    return found


def pool_serving(pools: EnginePool, name: str) -> ModelPool | None:
    """The pool of the base model one of whose replicas serves adapter `name`, if any."""
    for pool in pools.models.values():
        if any(name in engine.adapters for engine in pool.engines):
            return pool
    return None


def lacking(engines: Sequence[Engine], adapter: str) -> list[Engine]:
    """The replicas that do not serve `adapter`: routing passes them over."""
    return [engine for engine in engines if adapter not in engine.adapters]


def all_adapter_cards(pools: EnginePool) -> list[dict[str, Any]]:
    """One card per adapter any replica serves (the first replica's), for the gateway's /v1/models."""
    cards: dict[str, dict[str, Any]] = {}
    for engine in pools.engines():
        for name, card in engine.adapters.items():
            if name not in pools.models:
                cards.setdefault(name, dict(card))
    return list(cards.values())


def adapter_names(pools: EnginePool) -> set[str]:
    return {name for engine in pools.engines() for name in engine.adapters}


def loaded(engine: Engine, name: str, path: str | None) -> None:
    """`engine` answered a load of adapter `name` with success: route it there from now on."""
    engine.adapter_changes += 1
    engine.adapters[name] = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": path,
        "parent": engine.model,
        "max_model_len": None,
        "permission": [],
    }


def unloaded(engine: Engine, name: str) -> None:
    engine.adapter_changes += 1
    engine.adapters.pop(name, None)
