"""Scored routing: each candidate replica gets a weighted sum of scores, and the best one wins.

Every scorer is a pure function returning 0..1 for one replica (higher is better):

- `prefix`: the share of the prompt's leading blocks the replica's prefix cache holds (the precise
  index, from the engine's KV events; or the approximate one, from what the gateway sent it).
- `balance`: 1 - (share of the prompt it does not hold) x (its cached blocks / the most any
  candidate holds). Sending a prompt adds its unmatched blocks to a cache; where that cache is
  already the fullest, they evict someone else's. It is what spreads tenants whose prompts share
  only a system prompt: on prefix alone, the first replica to hold that system prompt would win
  them all (today's prefix-key affinity does exactly that).
- `kv_usage`: 1 - the engine's KV-cache usage (vllm:kv_cache_usage_perc; 0.5 when unknown).
- `queue`: 1 - waiting / max(most waiting, scale) (vllm:num_requests_waiting).
- `outstanding`: 1 - outstanding / max(most outstanding, scale), the gateway's own count.
- `session`: 1 for the replica the request's session id or `user` prefers (rendezvous hashing,
  routing.py), else 0.

The two load scorers divide by at least `scale` (the routing's `max_imbalance`), so one request
more is worth 1/scale of their weight, not all of it (min-max over two replicas would turn any
difference into the full weight and drown the cache scores). The load bound stays a hard limit:
a replica with `max_imbalance` or more outstanding requests above the least loaded one is not a
candidate. Ties go to the caller's rotating turn.

The decision says why: the reason is the scorer that contributed most to the winner's lead over
the runner-up (`tie` when there was no lead, `only_choice` / `load_bound` when there was no
contest); `balance` only when the winner does not also hold more of the prompt (into equally full
caches, balance follows the prefix). No I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gateway.replicas.engine import Engine
from server.gateway.settings import Weights

SCORERS = ("prefix", "balance", "kv_usage", "queue", "outstanding", "session")
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica as the scorers see it."""

    engine: Engine
    matched: int = 0  # leading prompt blocks its cache holds
    held: int = 0  # blocks its cache holds in all (per the same index)


@dataclass(frozen=True, slots=True)
class Decision:
    """The replica chosen for one request, and why."""

    engine: Engine
    reason: str
    policy: str
    source: str = "none"  # where the prefix matches came from: precise, approximate, none
    prompt_blocks: int = 0
    candidates: tuple[Candidate, ...] = ()
    scores: tuple[float, ...] = ()  # total score per candidate, in the same order
    parts: dict[str, float] = field(default_factory=dict)  # the winner's score per scorer

    def explain(self) -> dict[str, Any]:
        """The access log's `routing` field."""
        out: dict[str, Any] = {"engine": self.engine.id, "policy": self.policy, "reason": self.reason}
        if self.candidates:
            out["source"] = self.source
            out["prompt_blocks"] = self.prompt_blocks
            out["matched"] = {c.engine.id: c.matched for c in self.candidates}
            out["scores"] = {c.engine.id: round(s, 3) for c, s in zip(self.candidates, self.scores, strict=True)}
            out["parts"] = {name: round(value, 3) for name, value in self.parts.items()}
        return out


# -- the scorers --------------------------------------------------------------------------------


def prefix_score(candidate: Candidate, prompt_blocks: int) -> float:
    return candidate.matched / prompt_blocks if prompt_blocks > 0 else 0.0


def balance_score(candidate: Candidate, prompt_blocks: int, most_held: int) -> float:
    if prompt_blocks <= 0 or most_held <= 0:
        return 1.0
    unmatched = 1.0 - candidate.matched / prompt_blocks
    return 1.0 - unmatched * min(1.0, candidate.held / most_held)


def kv_usage_score(engine: Engine) -> float:
    usage = engine.metrics.kv_usage
    return 0.5 if usage is None else 1.0 - min(1.0, max(0.0, usage))


def queue_score(engine: Engine, most_waiting: float, scale: float) -> float:
    waiting = engine.metrics.waiting or 0.0
    return 1.0 - waiting / max(most_waiting, scale)


def outstanding_score(engine: Engine, most_outstanding: int, scale: float) -> float:
    return 1.0 - engine.outstanding / max(most_outstanding, scale)


def session_score(engine: Engine, preferred: Engine | None) -> float:
    return 1.0 if engine is preferred else 0.0


def score_parts(
    candidates: Sequence[Candidate], *, prompt_blocks: int, preferred: Engine | None, scale: float
) -> list[dict[str, float]]:
    """Every scorer's value for every candidate (unweighted, 0..1)."""
    most_held = max((c.held for c in candidates), default=0)
    most_waiting = max((c.engine.metrics.waiting or 0.0 for c in candidates), default=0.0)
    most_outstanding = max((c.engine.outstanding for c in candidates), default=0)
    return [
        {
            "prefix": prefix_score(c, prompt_blocks),
            "balance": balance_score(c, prompt_blocks, most_held),
            "kv_usage": kv_usage_score(c.engine),
            "queue": queue_score(c.engine, most_waiting, scale),
            "outstanding": outstanding_score(c.engine, most_outstanding, scale),
            "session": session_score(c.engine, preferred),
        }
        for c in candidates
    ]


def total(parts: dict[str, float], weights: Weights) -> float:
    return sum(float(getattr(weights, name)) * value for name, value in parts.items())


def choose_scored(
    candidates: Sequence[Candidate],
    *,
    weights: Weights,
    prompt_blocks: int = 0,
    preferred: Engine | None = None,
    max_imbalance: int = 8,
    turn: int = 0,
    source: str = "none",
) -> Decision | None:
    """The best-scoring candidate within the load bound, or None when there is no candidate."""
    if not candidates:
        return None
    least = min(c.engine.outstanding for c in candidates)
    eligible = [c for c in candidates if c.engine.outstanding - least < max_imbalance]
    parts = score_parts(eligible, prompt_blocks=prompt_blocks, preferred=preferred, scale=float(max_imbalance))
    totals = [total(p, weights) for p in parts]
    best = max(totals)
    ties = [i for i, t in enumerate(totals) if t >= best - _EPSILON]
    winner = ties[turn % len(ties)]
    if len(eligible) == 1:
        reason = "only_choice" if len(candidates) == 1 else "load_bound"
    elif len(ties) > 1:
        reason = "tie"
    else:
        runner_up = max((i for i in range(len(eligible)) if i != winner), key=lambda i: totals[i])
        lead = {
            name: float(getattr(weights, name)) * (parts[winner][name] - parts[runner_up][name]) for name in SCORERS
        }
        reason = max(SCORERS, key=lambda name: lead[name])
        if reason == "balance" and parts[winner]["prefix"] > parts[runner_up]["prefix"]:
            reason = "prefix"  # into equally full caches, balance follows the prefix: it adds fewer blocks
    return Decision(
        eligible[winner].engine,
        reason,
        "cache_aware",
        source,
        prompt_blocks,
        tuple(eligible),
        tuple(totals),
        parts[winner],
    )
