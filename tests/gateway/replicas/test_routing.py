"""The routing choice as a pure function: load, ties, health, rendezvous affinity and its bound."""

from __future__ import annotations

from collections import Counter
from typing import get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.gateway.replicas.engine import Engine
from server.gateway.replicas.routing import (
    Policy,
    affinity_key,
    by_policy,
    choose,
    prompt_prefix,
    rendezvous_order,
)


def E(id: str, outstanding: int = 0, healthy: bool = True) -> Engine:
    """The engine the pool would hold for `http://{id}` (its id is `id`), in the given state."""
    engine = Engine("m", f"http://{id}")
    engine.outstanding, engine.healthy = outstanding, healthy
    assert engine.id == id
    return engine


def test_least_outstanding_wins():
    engines = [E("a", 3), E("b", 1), E("c", 2)]
    assert choose(engines).id == "b"


def test_ties_rotate_with_the_turn():
    engines = [E("a"), E("b"), E("c")]
    assert [choose(engines, turn=t).id for t in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_unhealthy_and_excluded_engines_are_never_chosen():
    a, b, c = E("a", 5), E("b", 0, healthy=False), E("c", 9)
    assert choose([a, b, c]) is a
    assert choose([a, b, c], exclude=[a]) is c
    assert choose([a, b, c], exclude=[a, c]) is None
    assert choose([a, b, c], key=b"k", exclude=[a, c]) is None
    assert choose([]) is None


def test_round_robin_ignores_load():
    engines = [E("a", 9), E("b", 0)]
    assert [choose(engines, policy="round_robin", turn=t).id for t in range(4)] == ["a", "b", "a", "b"]


def test_every_policy_name_the_config_accepts_has_a_policy():
    engines = [E("a", 1), E("b", 0)]
    for policy in get_args(Policy):
        assert by_policy(policy, engines, turn=0) in engines


def test_affinity_prefers_the_same_engine_whatever_the_load_within_the_bound():
    engines = [E(f"e{i}") for i in range(4)]
    first = choose(engines, key=b"session-1").id
    for engine in engines:
        engine.outstanding = 3 if engine.id == first else 0
    assert choose(engines, key=b"session-1", max_imbalance=4).id == first


def test_affinity_moves_to_the_next_preferred_engine_past_the_bound():
    engines = [E(f"e{i}") for i in range(4)]
    order = [e.id for e in rendezvous_order(b"hot", engines)]
    by_id = {e.id: e for e in engines}
    by_id[order[0]].outstanding = 8
    assert choose(engines, key=b"hot", max_imbalance=8).id == order[1]
    assert choose(engines, key=b"hot", max_imbalance=9).id == order[0]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.binary(min_size=1, max_size=40), st.integers(1, 10))
def test_the_chosen_engine_is_never_more_than_max_imbalance_above_the_least_loaded(loads, key, bound):
    engines = [E(f"e{i}", load) for i, load in enumerate(loads)]
    chosen = choose(engines, key=key, max_imbalance=bound)
    assert chosen.outstanding - min(loads) < bound


def test_rendezvous_moves_only_the_keys_of_a_removed_engine():
    engines = [E(f"10.0.0.{i}:8000") for i in range(5)]
    keys = [f"session-{i}".encode() for i in range(400)]
    before = {k: rendezvous_order(k, engines)[0].id for k in keys}
    gone = engines[2]
    after = {k: rendezvous_order(k, [e for e in engines if e is not gone])[0].id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.id for k in moved)
    assert min(Counter(before.values()).values()) > 400 / 5 / 2  # spread, not piled up


def test_affinity_key_precedence_session_then_user_then_prefix():
    body = {"messages": [{"role": "system", "content": "x" * 300}], "user": "bob"}
    kwargs = {"prefix_affinity": True, "prefix_chars": 100, "prefix_min_chars": 50}
    assert affinity_key(body, session="s1", **kwargs) == b"s\x00s1"
    assert affinity_key(body, session=None, **kwargs) == b"u\x00bob"
    del body["user"]
    assert affinity_key(body, session=None, **kwargs).startswith(b"p\x00")
    assert affinity_key(body, session=None, **{**kwargs, "prefix_affinity": False}) is None
    assert affinity_key({"prompt": "short"}, session=None, **kwargs) is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "abcdef"}, "abcd"),
        ({"prompt": ["abcdef", "zzz"]}, "abcd"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}, "\x1euser\x1fab"[:4]),
    ],
)
def test_prompt_prefix(body, expected):
    assert prompt_prefix(body, 4) == expected


def test_requests_sharing_a_long_system_prompt_share_a_key_and_differ_otherwise():
    system = {"role": "system", "content": "s" * 2000}
    kwargs = {"session": None, "prefix_affinity": True, "prefix_chars": 1024, "prefix_min_chars": 256}
    one = affinity_key({"messages": [system, {"role": "user", "content": "a"}]}, **kwargs)
    two = affinity_key({"messages": [system, {"role": "user", "content": "b"}]}, **kwargs)
    other = affinity_key({"messages": [{"role": "system", "content": "t" * 2000}]}, **kwargs)
    assert one == two != other
