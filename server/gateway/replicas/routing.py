"""Which replica of a model gets a request: pure functions over `Engine`s, no I/O, no clocks.

A request with an affinity key (a session id, the OpenAI `user` field, or the beginning of its
prompt) prefers one replica, chosen by rendezvous hashing: every (key, replica) pair gets a
score and the highest score wins, so a key keeps its replica while replicas come and go, and
only the keys of a vanished replica move. The preference is a preference: a replica that already
has `max_imbalance` more outstanding requests than the least loaded one is passed over for the
next one in the key's order, so one hot prefix or session cannot pile everything onto one engine.

Without a key, or when every preferred replica is too busy, the configured policy decides (one
function per policy, below `choose`): the healthy replica with the fewest outstanding requests,
ties broken by a rotating turn, so equal replicas share the load; or each in turn.

The default policy, `cache_aware`, is scored instead (scoring.py, fed by the prefix indexes
through cache.py); the pool (pool.py) calls it. Here it means least outstanding, which is what
it comes down to when nothing is known about the prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import assert_never

from server.gateway.replicas.engine import Engine
from server.gateway.settings import Policy


def choose(
    engines: Sequence[Engine],
    *,
    key: bytes | None = None,
    max_imbalance: int = 8,
    turn: int = 0,
    policy: Policy = "least_outstanding",
    exclude: Collection[Engine] = (),
) -> Engine | None:
    """The replica for one request, or None when no healthy replica is left.

    `turn` is a counter the caller advances per request (tie-breaking and round robin);
    `exclude` holds replicas already tried for this request.
    """
    chosen = choose_with_reason(
        engines, key=key, max_imbalance=max_imbalance, turn=turn, policy=policy, exclude=exclude
    )
    return chosen[0] if chosen is not None else None


def choose_with_reason(
    engines: Sequence[Engine],
    *,
    key: bytes | None = None,
    max_imbalance: int = 8,
    turn: int = 0,
    policy: Policy = "least_outstanding",
    exclude: Collection[Engine] = (),
) -> tuple[Engine, str] | None:
    """`choose`, and what decided: `affinity` (the key's replica) or the policy's name."""
    live = [e for e in engines if e.healthy and e not in exclude]
    if not live:
        return None
    if key is not None:
        least = min(e.outstanding for e in live)
        for engine in rendezvous_order(key, live):
            if engine.outstanding - least < max_imbalance:
                return engine, "affinity"
    return by_policy(policy, live, turn), policy


# -- policies: one function each, choosing among live replicas -----------------------------------
# A new policy is a function here, a `case` in `by_policy` and its name in `Policy`. The scored
# policy reads the engines' own figures and the prefix indexes: scoring.py (a new scorer goes
# there), with the indexes in approximate.py and precise.py, joined in cache.py.


def by_policy(policy: Policy, live: Sequence[Engine], turn: int) -> Engine:
    """The replica `policy` picks among `live` (not empty)."""
    match policy:
        case "least_outstanding" | "cache_aware":
            return least_outstanding(live, turn)
        case "round_robin":
            return round_robin(live, turn)
    assert_never(policy)


def least_outstanding(live: Sequence[Engine], turn: int) -> Engine:
    """The replica with the fewest outstanding requests; the turn rotates among equals."""
    least = min(e.outstanding for e in live)
    ties = [e for e in live if e.outstanding == least]
    return ties[turn % len(ties)]


def round_robin(live: Sequence[Engine], turn: int) -> Engine:
    """Each replica in turn, whatever its load."""
    return live[turn % len(live)]


# -- affinity ----------------------------------------------------------------------------------


def _score(key: bytes, engine_id: str) -> int:
    digest = hashlib.blake2b(key, digest_size=8, key=engine_id.encode()[:64]).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: bytes, engines: Sequence[Engine]) -> list[Engine]:
    """`engines` from most to least preferred for `key` (highest random weight first)."""
    key = hashlib.blake2b(key, digest_size=16).digest()  # long prefixes are hashed once
    return sorted(engines, key=lambda e: (_score(key, e.id), e.id), reverse=True)


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(text for p in content if isinstance(p, dict) and isinstance(text := p.get("text"), str))
    return ""


def prompt_prefix(body: Mapping[str, object], limit: int) -> str:
    """The first `limit` characters of what the engine will see first: the prompt or the messages."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return prompt[:limit] if isinstance(prompt, str) else repr(prompt)[:limit]
    messages = body.get("messages")
    parts: list[str] = []
    size = 0
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            break
        text = f"\x1e{message.get('role', '')}\x1f{_text_of(message.get('content'))}"
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def is_session_key(key: bytes | None) -> bool:
    """A key from a session header or the `user` field (not from the prompt)."""
    return key is not None and key[:2] in (b"s\x00", b"u\x00")


def affinity_key(
    body: Mapping[str, object], *, session: str | None, prefix_affinity: bool, prefix_chars: int, prefix_min_chars: int
) -> bytes | None:
    """The key a request should stick to: session header, then `user`, then its prompt's prefix."""
    if session:
        return b"s\x00" + session.encode()
    user = body.get("user")
    if isinstance(user, str) and user:
        return b"u\x00" + user.encode()
    if prefix_affinity:
        prefix = prompt_prefix(body, prefix_chars)
        if len(prefix) >= prefix_min_chars:
            return b"p\x00" + prefix.encode("utf-8", "surrogatepass")
    return None
