"""A multi-tenant workload for cache-aware routing: many tenants, each with its own long system
prompt, some sharing the beginning of it, and multi-turn conversations without session headers.

Tenants come in families of `family_size` consecutive tenants (by default one family). The
tenants of one family share their first `shared_chars` characters, or a few less (cut at a
space): a platform preamble, the policies and tone of one product. They differ after it (each
tenant's own catalogue of places, opening hours and prices), up to `system_chars` characters.
With `shared_chars` above the gateway's `prefix_chars` (1,024), a prefix-key affinity sees one
key per family, not per tenant.

Every tenant has `conversations` conversations of `turns` user turns each; the answers join the
history the next turn carries (`loadtest.scenarios.Session`). `sessions()` orders them the way
the experiment sends them: the first conversation of every tenant, then the second of every
tenant, ... so that between two visits of one tenant every other tenant comes by once: a cache
that cannot hold every tenant evicts the one that comes next (LRU, the worst case), while a
replica that holds half of the tenants keeps them all.

Deterministic: the same arguments give the same prompts (seeded per tenant and conversation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.scenarios import ScenarioError, Session, fit, poi_context
from loadtest.texts import CITIES, NAMES, PREFERENCES, QUESTIONS, SYSTEM_PROMPT

PRODUCTS = (
    "Wayfarer Travel Desk",
    "Harbour Lines Concierge",
    "Northern Rail Holidays",
    "Old Town Guides",
    "Blue Ferry Company",
    "Summit Hut Bookings",
)


@dataclass(frozen=True)
class Workload:
    """The shape of the multi-tenant workload (every field is a command-line option)."""

    tenants: int = 12
    family_size: int = 12  # one family: every tenant starts with the same platform preamble
    shared_chars: int = 1300
    system_chars: int = 2600
    conversations: int = 4
    turns: int = 2
    max_tokens: int = 8  # short answers: TTFT is the figure, decoding only costs the run time
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.family_size < 1 or self.conversations < 1 or self.turns < 1:
            raise ScenarioError("tenants, family size, conversations and turns must be at least 1")
        if not 0 <= self.shared_chars < self.system_chars:
            raise ScenarioError("the shared part must be shorter than the system prompt")

    @property
    def requests(self) -> int:
        return self.tenants * self.conversations * self.turns

    def family(self, tenant: int) -> int:
        return tenant // self.family_size


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(":".join(str(p) for p in (seed, "tenants", *parts)))


def preamble(workload: Workload, family: int) -> str:
    """The beginning every system prompt of one family shares: about `shared_chars` characters."""
    product = PRODUCTS[family % len(PRODUCTS)]
    head = f"You are the assistant of {product} (family {family}). "
    return fit(head + SYSTEM_PROMPT, workload.shared_chars) if workload.shared_chars else ""


def system_prompt(workload: Workload, tenant: int) -> str:
    """Tenant `tenant`'s system prompt: its family's preamble, then its own catalogue."""
    rng = _rng(workload.seed, "tenant", tenant)
    city = CITIES[tenant % len(CITIES)]
    own = f"\n\nTenant {tenant}: the {city} office. Answer only about {city}.\n"
    rest = workload.system_chars - workload.shared_chars - len(own)
    catalogue = poi_context(rng, city, max(rest, 0))
    return (preamble(workload, workload.family(tenant)) + own + catalogue)[: workload.system_chars]


def tenant_of(session: Session) -> int:
    """The tenant a session of `sessions()` belongs to (its id is `tenant-T-conversation-C`)."""
    return int(session.id.split("-")[1])


def sessions(workload: Workload) -> list[Session]:
    """Every conversation, in sending order (see the module docstring)."""
    systems = [system_prompt(workload, t) for t in range(workload.tenants)]
    out = []
    for conversation in range(workload.conversations):
        for tenant in range(workload.tenants):
            rng = _rng(workload.seed, "conversation", tenant, conversation)
            turns = tuple(
                {
                    "role": "user",
                    "content": rng.choice(QUESTIONS).format(
                        day=turn + 1, poi=rng.choice(NAMES), pref=rng.choice(PREFERENCES)
                    ),
                }
                for turn in range(workload.turns)
            )
            out.append(
                Session(
                    f"tenant-{tenant}-conversation-{conversation}",
                    ({"role": "system", "content": systems[tenant]},),
                    turns,
                    (workload.max_tokens,) * workload.turns,
                )
            )
    return out
