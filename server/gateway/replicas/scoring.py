"""Scored routing: each candidate replica gets a weighted sum of scores, and the best one wins.

Every scorer is a pure function returning 0..1 for one replica (higher is better):

- `prefix`: the share of the prompt's leading blocks the replica's prefix cache holds (the precise
  index, from the engine's KV events; or the approximate one, from what the gateway sent it),
  counting only the blocks that tell the candidates apart (`block_weights`): a block every
  candidate holds counts 0, a block of a hot shared prefix (one that more than one replica's share
  of the recent prompts began with, `hot_blocks`: a company's house rules every tenant's system
  prompt opens with) counts `SHARED_BLOCK_WEIGHT`, every other block 1. A hot shared prefix is on
  every replica that serves any of its prompts, so matching it is worth one prefill of it, once;
  on plain block counts, the replica that served its first prompt matched every later prompt
  and nothing else did, and it won all of them (96 of 96 in issue 34's run) while its cache
  thrashed and the other sat empty.
- `balance`: 1 - (share of the prompt it does not hold) x (its cached blocks / the most any
  candidate holds). Sending a prompt adds its unmatched blocks to a cache; where that cache is
  already the fullest, they evict someone else's. It is what spreads tenants whose prompts share
  only a system prompt.
- `fit`: 1 - (share of the prompt it does not hold) x (its cache's pressure: how full it is and
  whether it is evicting, 0..1, from cache.py: blocks held over capacity, KV usage, recent
  `BlockRemoved` events). The absolute counterpart of `balance`: a replica whose cache is full and
  evicting pays for every block the request would add, one with room does not.
- `kv_usage`: 1 - the engine's KV-cache usage (vllm:kv_cache_usage_perc; 0.5 when unknown).
- `queue`: 1 - waiting / max(most waiting, scale) (vllm:num_requests_waiting).
- `outstanding`: 1 - outstanding / max(most outstanding, scale), the gateway's own count.
- `spread`: 1 - how far the replica's share of the recently routed requests (the pool's window)
  is above an even share, as a fraction of the rest, once the window holds `min_window` requests
  (2 of the first 2 is no imbalance). In-flight counts do not see imbalance at low concurrency
  (two requests in flight: every replica has 0 or 1); the window does.
- `session`: 1 for the replica the request's session id or `user` prefers (rendezvous hashing,
  routing.py), else 0.

The two load scorers divide by at least `scale` (the routing's `max_imbalance`), so one request
more is worth 1/scale of their weight, not all of it (min-max over two replicas would turn any
difference into the full weight and drown the cache scores). The load bound stays a hard limit:
a replica with `max_imbalance` or more outstanding requests above the least loaded one is not a
candidate; nor, once the window holds `min_window` requests, is a replica whose share of it is
above `max_share` (the split guard: the requests it took recently would make it more than
`max_split` times another's), unless every candidate is. Both `spread` and the guard stay out
of a decision where the candidates' in-flight counts differ by `STALL_REQUESTS` (2) or more
(those counts tell the loads apart; a stalled replica's share falls while its requests hang), and
from a request with a session id or `user`: it keeps its replica within the load bound, as before.
Ties go to the caller's rotating turn.

The wait rule, at any concurrency: when the winner has requests in flight and another candidate
has none, the request goes to the idle one unless what the winner's cache saves outweighs the
wait, both in seconds (service.py, from the engines' own prefill and first-token figures): the
blocks the winner holds beyond the idle one's, times the seconds a computed block takes there
(`Candidate.block_seconds`), against the expected seconds of its in-flight requests' work before
their first tokens still ahead (`Candidate.wait`). In issue 34's hot-prefix
runs the scores sent a third of the requests to a replica that was busy while the other sat idle
(two requests in flight): behind a request still prefilling, for a cache saving of a few
milliseconds or none (a `balance` or `kv_usage` lead), which put them in the slowest tenth. A
request with a session id or `user` is left to its replica (load bound only), and the rule stays
out while the busy replica's costs are unknown (an engine that has computed too little to say).

The decision says why: the reason is the scorer that contributed most to the winner's lead over
the runner-up (`tie` when there was no lead, `only_choice` / `load_bound` when there was no
contest, `split_bound` when the split guard took the others out, `wait` when the wait rule moved
the request to an idle replica); `balance` only when the winner does not also hold more of the
prompt (into equally full caches, balance follows the prefix).
No I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gateway.replicas.engine import Engine
from server.gateway.settings import Weights

SCORERS = ("prefix", "balance", "fit", "kv_usage", "queue", "outstanding", "spread", "session")
SHARED_BLOCK_WEIGHT = 0.1  # a block of a hot shared prefix, against 1 for a block that tells prompts apart
# The window (`spread`, the split guard) is for when in-flight counts cannot tell replicas apart:
# once one candidate has this many more requests in flight than another, they can, and the window
# stays out. A replica that stalls (its requests do not finish) takes fewer new ones, so its share of
# the window falls: the window must not pile every client onto it.
STALL_REQUESTS = 2
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Candidate:
    """One replica as the scorers see it."""

    engine: Engine
    matched: int = 0  # leading prompt blocks its cache holds
    held: int = 0  # blocks its cache holds in all (per the same index)
    pressure: float = 0.0  # 0..1: how full its cache is and whether it is evicting (cache.py)
    recent: int = 0  # requests routed to it in the pool's recent window
    wait: float = 0.0  # expected seconds of its in-flight work still ahead of a request sent now (service.py)
    block_seconds: float = 0.0  # what computing one prompt block (of the index's size) takes it (service.py)


@dataclass(frozen=True, slots=True)
class Decision:
    """The replica chosen for one request, and why."""

    engine: Engine
    reason: str
    policy: str
    source: str = "none"  # where the prefix matches came from: precise, approximate, none
    prompt_blocks: int = 0
    hot_blocks: int = 0  # leading prompt blocks of a hot shared prefix
    candidates: tuple[Candidate, ...] = ()
    scores: tuple[float, ...] = ()  # total score per candidate, in the same order
    parts: dict[str, float] = field(default_factory=dict)  # the winner's score per scorer

    def explain(self) -> dict[str, Any]:
        """The access log's `routing` field."""
        out: dict[str, Any] = {"engine": self.engine.id, "policy": self.policy, "reason": self.reason}
        if self.candidates:
            out["source"] = self.source
            out["prompt_blocks"] = self.prompt_blocks
            out["hot_blocks"] = self.hot_blocks
            out["matched"] = {c.engine.id: c.matched for c in self.candidates}
            out["scores"] = {c.engine.id: round(s, 3) for c, s in zip(self.candidates, self.scores, strict=True)}
            if any(c.wait for c in self.candidates):
                out["wait_ms"] = {c.engine.id: round(c.wait * 1000, 1) for c in self.candidates}
            out["parts"] = {name: round(value, 3) for name, value in self.parts.items()}
        return out


# -- the scorers --------------------------------------------------------------------------------


def block_weights(prompt_blocks: int, common: int, hot_blocks: int) -> list[float]:
    """Each prompt block's weight in `prefix`: 0 for the leading `common` blocks every candidate
    holds (they tell no candidate apart), SHARED_BLOCK_WEIGHT for the rest of a hot shared prefix
    (`hot_blocks`: every replica will hold it soon anyway), 1 for the blocks that tell prompts apart."""
    return [0.0 if i < common else SHARED_BLOCK_WEIGHT if i < hot_blocks else 1.0 for i in range(max(0, prompt_blocks))]


def prefix_score(candidate: Candidate, prompt_blocks: int, weights: Sequence[float] | None = None) -> float:
    """The (weighted) share of the prompt's blocks the candidate holds; plain counts without weights."""
    if prompt_blocks <= 0:
        return 0.0
    if weights is None:
        return min(candidate.matched, prompt_blocks) / prompt_blocks
    whole = sum(weights)
    return sum(weights[: candidate.matched]) / whole if whole > _EPSILON else 0.0


def balance_score(candidate: Candidate, prompt_blocks: int, most_held: int) -> float:
    if prompt_blocks <= 0 or most_held <= 0:
        return 1.0
    unmatched = 1.0 - candidate.matched / prompt_blocks
    return 1.0 - unmatched * min(1.0, candidate.held / most_held)


def fit_score(candidate: Candidate, prompt_blocks: int) -> float:
    if prompt_blocks <= 0:
        return 1.0
    unmatched = 1.0 - min(candidate.matched, prompt_blocks) / prompt_blocks
    return 1.0 - unmatched * min(1.0, max(0.0, candidate.pressure))


def spread_score(candidate: Candidate, window: int, replicas: int) -> float:
    """1 at or below an even share of the window's requests, 0 when it took all of them."""
    if window <= 0 or replicas <= 1:
        return 1.0
    even = 1.0 / replicas
    share = min(1.0, candidate.recent / window)
    return 1.0 - max(0.0, share - even) / (1.0 - even)


def worth_the_wait(busy: Candidate, idle: Candidate) -> bool:
    """Whether `busy`'s cache saves more seconds than `busy`'s in-flight work costs a request sent
    now: the blocks it holds beyond what `idle` holds, at its `block_seconds` each, against its
    `wait`."""
    saved = max(0, busy.matched - idle.matched) * max(0.0, busy.block_seconds)
    return saved > busy.wait


def max_share(replicas: int, max_split: float) -> float:
    """The largest share of the window one replica may take: `max_split` times each of the others'."""
    return max_split / (max_split + replicas - 1) if replicas > 1 else 1.0


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
    candidates: Sequence[Candidate],
    *,
    prompt_blocks: int,
    preferred: Engine | None,
    scale: float,
    hot_blocks: int = 0,
    window: int = 0,
    replicas: int | None = None,
) -> list[dict[str, float]]:
    """Every scorer's value for every candidate (unweighted, 0..1)."""
    common = min((c.matched for c in candidates), default=0) if len(candidates) > 1 else 0
    weights = block_weights(prompt_blocks, common, hot_blocks)
    replicas = len(candidates) if replicas is None else replicas
    most_held = max((c.held for c in candidates), default=0)
    most_waiting = max((c.engine.metrics.waiting or 0.0 for c in candidates), default=0.0)
    most_outstanding = max((c.engine.outstanding for c in candidates), default=0)
    return [
        {
            "prefix": prefix_score(c, prompt_blocks, weights),
            "balance": balance_score(c, prompt_blocks, most_held),
            "fit": fit_score(c, prompt_blocks),
            "kv_usage": kv_usage_score(c.engine),
            "queue": queue_score(c.engine, most_waiting, scale),
            "outstanding": outstanding_score(c.engine, most_outstanding, scale),
            "spread": spread_score(c, window, replicas),
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
    hot_blocks: int = 0,
    window: int = 0,
    min_window: int = 16,
    max_split: float = 1.4,
) -> Decision | None:
    """The best-scoring candidate within the load bound and the split guard, then the wait rule,
    or None when there is no candidate. `window`: requests in the pool's recent window (each
    candidate's `recent` counts its own share of them)."""
    if not candidates:
        return None
    if preferred is not None or window < min_window:
        window = 0  # a session's requests keep their replica (load bound only); a few requests say little
    least = min(c.engine.outstanding for c in candidates)
    eligible = [c for c in candidates if c.engine.outstanding - least < max_imbalance]
    if max(c.engine.outstanding for c in eligible) - least >= STALL_REQUESTS:
        window = 0  # in-flight counts tell the loads apart: the window must not pull toward a stalled replica
    split_bound = False
    if window and len(candidates) > 1:
        limit = max_share(len(candidates), max_split) * window
        within = [c for c in eligible if c.recent < limit]
        if within and len(within) < len(eligible):
            eligible, split_bound = within, True
    parts = score_parts(
        eligible,
        prompt_blocks=prompt_blocks,
        preferred=preferred,
        scale=float(max_imbalance),
        hot_blocks=hot_blocks,
        window=window,
        replicas=len(candidates),
    )
    totals = [total(p, weights) for p in parts]
    best = max(totals)
    ties = [i for i, t in enumerate(totals) if t >= best - _EPSILON]
    winner = ties[turn % len(ties)]
    waited = False
    if preferred is None and eligible[winner].engine.outstanding and eligible[winner].block_seconds > 0:
        idle = [i for i, c in enumerate(eligible) if not c.engine.outstanding]
        if idle:
            best_idle = max(idle, key=lambda i: totals[i])
            if not worth_the_wait(eligible[winner], eligible[best_idle]):
                winner, waited = best_idle, True
    if waited:
        reason = "wait"
    elif len(eligible) == 1:
        reason = "only_choice" if len(candidates) == 1 else "split_bound" if split_bound else "load_bound"
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
        hot_blocks,
        tuple(eligible),
        tuple(totals),
        parts[winner],
    )
