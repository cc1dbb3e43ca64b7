"""Scored routing as pure functions: each scorer, the weighted choice, the load bound, the reason."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.gateway.replicas.engine import Engine, EngineMetrics
from server.gateway.replicas.scoring import (
    SCORERS,
    Candidate,
    Weights,
    balance_score,
    choose_scored,
    kv_usage_score,
    outstanding_score,
    prefix_score,
    queue_score,
    score_parts,
    session_score,
)

ONLY = {name: 0.0 for name in SCORERS}


def E(id: str, outstanding: int = 0, *, kv_usage: float | None = None, waiting: float | None = None) -> Engine:
    engine = Engine("m", f"http://{id}")
    engine.outstanding = outstanding
    engine.metrics = EngineMetrics(kv_usage=kv_usage, waiting=waiting)
    return engine


def only(**weights: float) -> Weights:
    """Weights with every scorer off but the ones named."""
    return Weights(**{**ONLY, **weights})


def test_prefix_is_the_share_of_the_prompt_held():
    assert prefix_score(Candidate(E("a"), matched=3), 4) == 0.75
    assert prefix_score(Candidate(E("a"), matched=0), 4) == 0.0
    assert prefix_score(Candidate(E("a")), 0) == 0.0  # a prompt shorter than a block


def test_balance_weighs_the_blocks_a_prompt_adds_by_how_full_the_cache_is():
    full, empty = Candidate(E("a"), matched=4, held=100), Candidate(E("b"), matched=0, held=0)
    assert balance_score(empty, 10, 100) == 1.0  # nothing held: adding costs nobody anything
    assert balance_score(full, 10, 100) == pytest.approx(0.4)  # 6 new blocks of 10 into the fullest cache
    assert balance_score(Candidate(E("c"), matched=10, held=100), 10, 100) == 1.0  # adds nothing
    assert balance_score(full, 0, 100) == 1.0
    assert balance_score(Candidate(E("d"), matched=0, held=50), 10, 100) == pytest.approx(0.5)


def test_kv_usage_is_the_free_share_and_neutral_when_unknown():
    assert kv_usage_score(E("a", kv_usage=0.25)) == 0.75
    assert kv_usage_score(E("a", kv_usage=1.5)) == 0.0  # a bad figure is clamped
    assert kv_usage_score(E("a")) == 0.5


def test_load_scores_count_one_request_as_a_fraction_of_the_scale():
    assert outstanding_score(E("a", 1), 1, 8) == pytest.approx(7 / 8)  # not 0: min-max would say 0
    assert outstanding_score(E("a", 0), 1, 8) == 1.0
    assert outstanding_score(E("a", 16), 16, 8) == 0.0  # past the scale: the most loaded scores 0
    assert queue_score(E("a", waiting=2), 2, 8) == pytest.approx(0.75)
    assert queue_score(E("a"), 0, 8) == 1.0  # no figure: nothing waiting


def test_session_scores_the_preferred_replica_only():
    a, b = E("a"), E("b")
    assert session_score(a, a) == 1.0 and session_score(b, a) == 0.0 and session_score(a, None) == 0.0


@given(
    matched=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    blocks=st.integers(0, 20),
    held=st.lists(st.integers(0, 500), min_size=5, max_size=5),
    load=st.lists(st.integers(0, 40), min_size=5, max_size=5),
)
def test_every_score_is_between_0_and_1(matched: list[int], blocks: int, held: list[int], load: list[int]) -> None:
    candidates = [
        Candidate(E(f"e{i}", load[i], kv_usage=i / 4, waiting=float(load[-i - 1])), min(m, blocks), held[i])
        for i, m in enumerate(matched)
    ]
    for parts in score_parts(candidates, prompt_blocks=blocks, preferred=candidates[0].engine, scale=8):
        assert set(parts) == set(SCORERS)
        assert all(0.0 <= value <= 1.0 for value in parts.values())


def test_the_prompts_replica_wins_on_prefix():
    a, b = E("a"), E("b")
    decision = choose_scored([Candidate(a, 1, 10), Candidate(b, 7, 10)], weights=Weights(), prompt_blocks=8)
    assert decision is not None and decision.engine is b and decision.reason == "prefix"
    assert decision.source == "none" and decision.policy == "cache_aware"


def test_a_returning_tenant_stays_where_its_blocks_are_despite_a_little_more_load():
    home, other = E("home", 3), E("other", 1)
    # Its own 7 of 8 blocks at home; only the shared system prompt (4 blocks) on the other.
    decision = choose_scored([Candidate(home, 7, 48), Candidate(other, 4, 48)], weights=Weights(), prompt_blocks=8)
    assert decision is not None and decision.engine is home


def test_a_new_tenant_sharing_only_the_system_prompt_goes_to_the_emptier_cache():
    busy, idle = E("busy"), E("idle")
    # The system prompt (4 of 7 blocks) is held by the replica that took every tenant so far.
    candidates = [Candidate(busy, 4, 44), Candidate(idle, 0, 0)]
    decision = choose_scored(candidates, weights=Weights(), prompt_blocks=7)
    assert decision is not None and decision.engine is idle and decision.reason == "balance"
    # On prefix alone the system prompt would pull it to the busy one, as today's prefix key does.
    pulled = choose_scored(candidates, weights=only(prefix=1), prompt_blocks=7)
    assert pulled is not None and pulled.engine is busy


def test_the_load_bound_is_a_hard_limit_whatever_the_scores():
    hot, cold = E("hot", 8), E("cold", 0)
    decision = choose_scored(
        [Candidate(hot, 8, 8), Candidate(cold, 0, 0)], weights=only(prefix=100), prompt_blocks=8, max_imbalance=8
    )
    assert decision is not None and decision.engine is cold and decision.reason == "load_bound"
    near = choose_scored(
        [Candidate(E("hot", 7), 8, 8), Candidate(E("cold", 0), 0, 0)],
        weights=only(prefix=100),
        prompt_blocks=8,
        max_imbalance=8,
    )
    assert near is not None and near.engine.id == "hot"


def test_load_decides_when_nothing_is_known_about_the_prompt():
    decision = choose_scored([Candidate(E("a", 2)), Candidate(E("b", 1))], weights=Weights())
    assert decision is not None and decision.engine.id == "b" and decision.reason == "outstanding"
    queued = choose_scored([Candidate(E("a", waiting=5)), Candidate(E("b", waiting=0))], weights=Weights())
    assert queued is not None and queued.engine.id == "b" and queued.reason == "queue"
    full = choose_scored([Candidate(E("a", kv_usage=0.9)), Candidate(E("b", kv_usage=0.1))], weights=Weights())
    assert full is not None and full.engine.id == "b" and full.reason == "kv_usage"


def test_the_session_replica_wins_among_equals():
    a, b = E("a"), E("b")
    decision = choose_scored([Candidate(a), Candidate(b)], weights=Weights(), preferred=b)
    assert decision is not None and decision.engine is b and decision.reason == "session"


def test_ties_rotate_with_the_turn_and_say_so():
    engines = [E("a"), E("b"), E("c")]
    chosen = []
    for turn in range(6):
        decision = choose_scored([Candidate(e) for e in engines], weights=Weights(), turn=turn)
        assert decision is not None and decision.reason == "tie"
        chosen.append(decision.engine.id)
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_a_weight_of_zero_turns_a_scorer_off():
    a, b = E("a", 0), E("b", 5)
    decision = choose_scored([Candidate(a, 0, 0), Candidate(b, 8, 8)], weights=only(outstanding=1), prompt_blocks=8)
    assert decision is not None and decision.engine is a


def test_no_candidate_no_decision_and_a_single_one_is_no_contest():
    assert choose_scored([], weights=Weights()) is None
    decision = choose_scored([Candidate(E("a", 30))], weights=Weights())
    assert decision is not None and decision.reason == "only_choice"


def test_the_explanation_names_the_replica_matches_and_scores():
    a, b = E("a"), E("b")
    decision = choose_scored(
        [Candidate(a, 2, 10), Candidate(b, 6, 10)], weights=Weights(), prompt_blocks=8, source="precise"
    )
    assert decision is not None
    explained = decision.explain()
    assert explained["engine"] == "b" and explained["reason"] == "prefix" and explained["source"] == "precise"
    assert explained["prompt_blocks"] == 8 and explained["matched"] == {"a": 2, "b": 6}
    assert explained["scores"]["b"] > explained["scores"]["a"]
    assert set(explained["parts"]) == set(SCORERS)


def test_weights_refuse_unknown_scorers_and_negative_values():
    with pytest.raises(ValueError):
        Weights(prefix=-1)
    with pytest.raises(ValueError):
        Weights(cache=1.0)  # type: ignore[call-arg]
    assert dataclasses.is_dataclass(Candidate)
