"""The routing experiment's workloads, by name: the shape of the prompts (loadtest.tenants), how
many clients send them at once, and in what order.

- `tenants` (the experiment's own since the cache-aware routing issue): 12 tenants sharing a
  1,300-character preamble, each with its own 2,600-character system prompt, 4 two-turn
  conversations each, the first conversation of every tenant, then the second, ...; 4 at a time.
- `hot-prefix` (issue 34): 24 tenants whose system prompts open with the same ~1,300 characters of
  house rules (5 blocks of 128 tokens) and then differ (~6 blocks each), 4 single-turn questions
  per tenant, shuffled, 2 at a time: the working set is about three times one replica's cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.scenarios import Session
from loadtest.tenants import Workload, sessions


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    workload: Workload
    concurrency: int
    shuffle: bool


WORKLOADS: dict[str, WorkloadSpec] = {
    "tenants": WorkloadSpec("tenants", Workload(), concurrency=4, shuffle=False),
    "hot-prefix": WorkloadSpec(
        "hot-prefix",
        Workload(tenants=24, family_size=24, shared_chars=1300, system_chars=2700, conversations=4, turns=1),
        concurrency=2,
        shuffle=True,
    ),
}


def ordered_sessions(spec: WorkloadSpec, seed: int = 0) -> list[Session]:
    """The workload's conversations in sending order (shuffled by `seed` when the spec says so)."""
    out = sessions(spec.workload)
    if spec.shuffle:
        random.Random(f"{spec.name}:{seed}").shuffle(out)
    return out
