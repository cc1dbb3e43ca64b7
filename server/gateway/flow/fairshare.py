"""Fair shares between tenants: virtual token counters (VTC, arXiv 2401.00588), charged on what a
request costs the engine.

Each tenant has a counter of the tokens the engine worked for it: uncached prompt tokens (the
prefix index's estimate when admitted, the engine's own `cached_tokens` once it answers) plus
output tokens (a reservation when admitted, `max_tokens` or a default, settled from the answer's
usage). A request let in at once, while there is room, has its prompt unread: its reservation
counts the tenant's recent prompt cost instead (`PromptCosts`), so a counter shows the prompts
of a batch still in flight before their answers settle. Within a class the queue admits the
waiting tenant with the smallest counter next. A tenant that starts waiting after a pause is
lifted to the smallest counter of those already waiting, so idleness banks no credit (VTC's
rule); that keeps the served-token shares of backlogged tenants within a bounded distance of
each other, whatever the number of requests each sends.
"""

from __future__ import annotations

from collections.abc import Iterable


class VirtualCounters:
    """The tenants' virtual token counters (see the module doc); pure state, no clock."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def get(self, tenant: str) -> float:
        return self.values.get(tenant, 0.0)

    def charge(self, tenant: str, tokens: float) -> None:
        """Add `tokens` (negative: a settlement that returns part of a reservation; never below 0)."""
        self.values[tenant] = max(0.0, self.values.get(tenant, 0.0) + tokens)

    def lift(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant` starts waiting: at least the smallest counter among the `waiting` tenants."""
        floor = min((self.get(t) for t in waiting if t != tenant), default=None)
        if floor is not None and self.get(tenant) < floor:
            self.values[tenant] = floor


def prompt_charge(prompt_tokens: int, cached_tokens: int) -> int:
    """What a prompt cost the engine: its tokens minus those found in the prefix cache."""
    return max(0, prompt_tokens - min(cached_tokens, prompt_tokens))


class PromptCosts:
    """What each tenant's prompts cost the engine lately (uncached tokens, a moving average of
    settled answers; a tenant new to a model: the model's average, else 0). Pure state, no clock."""

    __slots__ = ("tenants", "models")
    WEIGHT = 0.2  # of the newest answer

    def __init__(self) -> None:
        self.tenants: dict[tuple[str, str], float] = {}
        self.models: dict[str, float] = {}

    def expect(self, model: str, tenant: str) -> float:
        known = self.tenants.get((model, tenant))
        return known if known is not None else self.models.get(model, 0.0)

    def settled(self, model: str, tenant: str, tokens: int) -> None:
        """An answer's prompt cost `tokens` (prompt_charge): each average moves by WEIGHT toward it."""
        weight = self.WEIGHT
        average = self.tenants.get((model, tenant))
        self.tenants[model, tenant] = tokens if average is None else average + weight * (tokens - average)
        average = self.models.get(model)
        self.models[model] = tokens if average is None else average + weight * (tokens - average)
