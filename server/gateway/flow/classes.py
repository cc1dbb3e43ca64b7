"""Priority classes: which one a request runs in, and the number vLLM's scheduler is given for it.

A request's class is its tenant's (settings `Tenant.priority`); the client may lower it with an
`x-priority` header (`batch` under an `interactive` tenant), never raise it: a header naming a
higher class, or no class at all, is ignored. vLLM's priority scheduler (`--scheduling-policy
priority`) runs the lower number first, so interactive is 0.
"""

from __future__ import annotations

from typing import Literal

Class = Literal["interactive", "standard", "batch"]

CLASSES: tuple[Class, ...] = ("interactive", "standard", "batch")  # first served first
RANK: dict[str, int] = {name: rank for rank, name in enumerate(CLASSES)}
VLLM_PRIORITY: dict[str, int] = dict(RANK)  # vLLM: lower is scheduled first (preempted last, KV short)
PRIORITY_HEADER = b"x-priority"


def request_class(tenant_class: Class, asked: str | None) -> Class:
    """The class a request runs in: the tenant's, or a lower one the client asked for."""
    if asked is None:
        return tenant_class
    wanted = asked.strip().lower()
    rank = RANK.get(wanted)
    if rank is None or rank <= RANK[tenant_class]:
        return tenant_class
    return CLASSES[rank]
