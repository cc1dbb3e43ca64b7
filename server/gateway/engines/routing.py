"""Which replica of a model gets a request: pure functions, no I/O, no clocks.

Default: the healthy replica with the fewest outstanding requests (ties broken by a rotating
turn, so equal replicas share the load). A request with an affinity key (a session id, the
OpenAI `user` field, or the beginning of its prompt) prefers one replica, chosen by
rendezvous hashing: every (key, replica) pair gets a score and the highest score wins, so a
key keeps its replica while replicas come and go, and only the keys of a vanished replica
move. The preference is a preference: a replica that already has `max_imbalance` more
outstanding requests than the least loaded one is passed over for the next one in the key's
order, so one hot prefix or session cannot pile everything onto one engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Any, Literal, Protocol, TypeVar

Policy = Literal["least_outstanding", "round_robin"]


class Candidate(Protocol):
    id: str
    healthy: bool
    outstanding: int


C = TypeVar("C", bound=Candidate)


def _score(key: bytes, engine_id: str) -> int:
    digest = hashlib.blake2b(key, digest_size=8, key=engine_id.encode()[:64]).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: bytes, engines: Sequence[C]) -> list[C]:
    """`engines` from most to least preferred for `key` (highest random weight first)."""
    key = hashlib.blake2b(key, digest_size=16).digest()  # long prefixes are hashed once
    return sorted(engines, key=lambda e: (_score(key, e.id), e.id), reverse=True)


def choose(engines: Sequence[C], *, key: bytes | None = None, max_imbalance: int = 8, turn: int = 0,
           policy: Policy = "least_outstanding", exclude: Collection[C] = ()) -> C | None:
    """The replica for one request, or None when no healthy replica is left.

    `turn` is a counter the caller advances per request (tie-breaking and round robin);
    `exclude` holds replicas already tried for this request.
    """
    live = [e for e in engines if e.healthy and e not in exclude]
    if not live:
        return None
    least = min(e.outstanding for e in live)
    if key is not None:
        for engine in rendezvous_order(key, live):
            if engine.outstanding - least < max_imbalance:
                return engine
    if policy == "round_robin":
        return live[turn % len(live)]
    ties = [e for e in live if e.outstanding == least]
    return ties[turn % len(ties)]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_prefix(body: dict[str, Any], limit: int) -> str:
    """The first `limit` characters of what the engine will see first: the prompt or the messages."""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return prompt[:limit] if isinstance(prompt, str) else repr(prompt)[:limit]
    parts: list[str] = []
    size = 0
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            break
        text = f"\x1e{message.get('role', '')}\x1f{_text_of(message.get('content'))}"
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def affinity_key(body: dict[str, Any], *, session: str | None, prefix_affinity: bool, prefix_chars: int,
                 prefix_min_chars: int) -> bytes | None:
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
