"""Fair shares between tenants: virtual token counters (VTC, arXiv 2401.00588), charged on what a
request costs the engine.

Each tenant has a counter of the tokens the engine worked for it: uncached prompt tokens (the
prefix index's estimate when admitted, the engine's own `cached_tokens` once it answers) plus
output tokens (a reservation when admitted, `max_tokens` or a default, settled from the answer's
usage). Within a class the queue admits the waiting tenant with the smallest counter next. A
tenant that starts waiting after a pause is lifted to the smallest counter of those already
waiting, so idleness banks no credit (VTC's rule); that keeps the served-token shares of
backlogged tenants within a bounded distance of each other, whatever the number of requests each
sends.
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
