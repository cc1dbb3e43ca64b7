"""Issue 34's rules for the scorer, on made-up states (pure, no I/O): blocks that tell replicas
apart decide, a hot shared prefix counts for little, a full and evicting cache pays for what it
would add, and the split stays even at two requests in flight."""

from __future__ import annotations

import pytest

from server.gateway.replicas.scoring import (
    SCORERS,
    SHARED_BLOCK_WEIGHT,
    Candidate,
    Weights,
    block_weights,
    choose_scored,
    fit_score,
    max_share,
    prefix_score,
    spread_score,
)
from tests.gateway.replicas.made_up import E

# Issue 34's prompt: 5 blocks of house rules every tenant's system prompt opens with, then 6 of its own.
SHARED, OWN = 5, 6
PROMPT = SHARED + OWN


def only(**weights: float) -> Weights:
    return Weights(**{**dict.fromkeys(SCORERS, 0.0), **weights})


def test_blocks_every_candidate_holds_count_nothing_and_a_hot_shared_prefix_little():
    assert block_weights(4, 0, 0) == [1.0] * 4
    assert block_weights(5, 2, 0) == [0.0, 0.0, 1.0, 1.0, 1.0]  # held by all: tells no one apart
    assert block_weights(5, 0, 3) == [SHARED_BLOCK_WEIGHT] * 3 + [1.0, 1.0]
    assert block_weights(5, 2, 3) == [0.0, 0.0, SHARED_BLOCK_WEIGHT, 1.0, 1.0]
    assert block_weights(0, 0, 3) == []


def test_matching_only_the_hot_shared_prefix_is_worth_little():
    weights = block_weights(PROMPT, 0, SHARED)
    shared_only = prefix_score(Candidate(E("a"), SHARED), PROMPT, weights)
    assert shared_only == pytest.approx(SHARED * SHARED_BLOCK_WEIGHT / (SHARED * SHARED_BLOCK_WEIGHT + OWN))
    assert shared_only < 0.1  # on plain counts it was 5/11
    assert prefix_score(Candidate(E("a"), SHARED), PROMPT) == pytest.approx(SHARED / PROMPT)
    assert prefix_score(Candidate(E("a"), PROMPT), PROMPT, weights) == 1.0
    # A prompt that is nothing but a hot prefix keeps its full prefix score where it is held.
    assert prefix_score(Candidate(E("a"), 3), 3, block_weights(3, 0, 3)) == 1.0
    assert prefix_score(Candidate(E("a"), 3), 3, block_weights(3, 3, 3)) == 0.0  # all held everywhere


def test_the_hot_shared_prefix_no_longer_pulls_every_tenant_to_the_replica_that_served_the_first():
    """Issue 34's run: every request matched the 5 shared blocks on the replica that served the
    first one and nothing on the other; the prefix score sent 96 of 96 there."""
    first, other = E("first", 1, kv_usage=0.2), E("other", 0)
    # The moment it started: the first replica just took a prompt (speculative blocks, its events
    # not in yet), the other is empty. On plain counts, the prefix decides for the first replica.
    early = [Candidate(first, SHARED, 0, 0.2), Candidate(other, 0, 0, 0.0)]
    before = choose_scored(early, weights=Weights(), prompt_blocks=PROMPT)
    assert before is not None and before.engine is first and before.reason == "prefix"
    # Once the house rules are seen as hot (more than one replica's share of recent prompts):
    after = choose_scored(early, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert after is not None and after.engine is other
    # Later: the first replica's cache is full and evicting, the other still empty.
    late = [Candidate(first, SHARED, 48, 1.0), Candidate(other, 0, 0, 0.0)]
    decision = choose_scored(late, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.engine is other
    assert decision.explain()["hot_blocks"] == SHARED


def test_the_distinguishing_blocks_decide_where_a_returning_tenant_goes():
    home, other = E("home", 1), E("other", 0)
    # Both hold the house rules; only home holds the tenant's own blocks, and home is full and evicting.
    candidates = [Candidate(home, PROMPT, 48, 1.0), Candidate(other, SHARED, 30, 0.6)]
    decision = choose_scored(candidates, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.engine is home and decision.reason == "prefix"
    assert decision.parts["prefix"] == 1.0  # the 5 blocks both hold count 0: 6 of 6 that tell them apart


def test_a_new_tenant_goes_where_it_fits_not_into_the_full_evicting_cache():
    evicting, roomy = E("evicting"), E("roomy")
    # Both hold the house rules and as many blocks; one is evicting (BlockRemoved lately), one is not.
    candidates = [Candidate(evicting, SHARED, 40, 1.0), Candidate(roomy, SHARED, 40, 0.3)]
    decision = choose_scored(candidates, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.engine is roomy and decision.reason == "fit"


def test_fit_charges_the_blocks_a_request_would_add_by_the_caches_pressure():
    assert fit_score(Candidate(E("a"), 0, pressure=1.0), 10) == 0.0  # all 10 new, cache full and evicting
    assert fit_score(Candidate(E("a"), 6, pressure=1.0), 10) == pytest.approx(0.6)
    assert fit_score(Candidate(E("a"), 0, pressure=0.0), 10) == 1.0  # room: adding costs nobody
    assert fit_score(Candidate(E("a"), 10, pressure=1.0), 10) == 1.0  # adds nothing
    assert fit_score(Candidate(E("a"), 0, pressure=1.0), 0) == 1.0  # no prompt blocks
    assert fit_score(Candidate(E("a"), 0, pressure=7.0), 10) == 0.0  # clamped


def test_spread_leans_against_a_replica_above_an_even_share_of_the_window():
    assert spread_score(Candidate(E("a"), recent=10), 20, 2) == 1.0
    assert spread_score(Candidate(E("a"), recent=5), 20, 2) == 1.0  # below even: no bonus
    assert spread_score(Candidate(E("a"), recent=15), 20, 2) == pytest.approx(0.5)
    assert spread_score(Candidate(E("a"), recent=20), 20, 2) == 0.0
    assert spread_score(Candidate(E("a"), recent=20), 0, 2) == 1.0  # no window
    assert spread_score(Candidate(E("a"), recent=20), 20, 1) == 1.0  # one replica
    a, b = E("a"), E("b")
    decision = choose_scored([Candidate(a, recent=11), Candidate(b, recent=9)], weights=Weights(), window=20)
    assert decision is not None and decision.engine is b and decision.reason == "spread"


def test_the_split_guard_holds_at_two_requests_in_flight_whatever_the_prefix():
    assert max_share(2, 1.5) == pytest.approx(0.6) and max_share(3, 2.0) == pytest.approx(0.5)
    assert max_share(1, 1.4) == 1.0
    home, other = E("home", 1), E("other", 0)
    # In-flight counts say nothing (1 and 0), but home took 30 of the last 48 requests (limit 28).
    candidates = [Candidate(home, PROMPT, 48, recent=30), Candidate(other, 0, 0, recent=18)]
    decision = choose_scored(candidates, weights=only(prefix=100), prompt_blocks=PROMPT, window=48)
    assert decision is not None and decision.engine is other and decision.reason == "split_bound"
    under = [Candidate(home, PROMPT, 48, recent=27), Candidate(other, 0, 0, recent=21)]
    kept = choose_scored(under, weights=Weights(), prompt_blocks=PROMPT, window=48)
    assert kept is not None and kept.engine is home  # within the bound the cache decides
    looser = choose_scored(candidates, weights=only(prefix=100), prompt_blocks=PROMPT, window=48, max_split=2.0)
    assert looser is not None and looser.engine is home  # 30 of 48 is within 2x


def test_the_window_needs_enough_requests_and_sessions_keep_their_replica():
    home, other = E("home"), E("other")
    few = [Candidate(home, 4, 4, recent=10), Candidate(other, 0, 0, recent=0)]
    decision = choose_scored(few, weights=only(prefix=1, spread=5), prompt_blocks=4, window=10)
    assert decision is not None and decision.engine is home  # 10 of 10 is too few to call a split
    many = [Candidate(home, 4, 4, recent=40), Candidate(other, 0, 0, recent=8)]
    guarded = choose_scored(many, weights=Weights(), prompt_blocks=4, window=48)
    assert guarded is not None and guarded.engine is other
    session = choose_scored(many, weights=Weights(), prompt_blocks=4, window=48, preferred=home)
    assert session is not None and session.engine is home  # a session id or user: load bound only


def test_the_guard_never_leaves_no_candidate():
    a, b = E("a"), E("b")
    # Shares that would exclude both (a window counted over replicas no longer live): no guard.
    decision = choose_scored(
        [Candidate(a, recent=40), Candidate(b, recent=40)], weights=Weights(), window=48, max_split=1.0
    )
    assert decision is not None and decision.reason == "tie"


def test_the_guard_never_piles_requests_onto_a_replica_whose_requests_hang():
    # B stalls: its requests do not finish, so its share of the window falls while A's grows.
    a, stalled = E("a", 0), E("b", 2)
    candidates = [Candidate(a, recent=36), Candidate(stalled, recent=12)]
    decision = choose_scored(candidates, weights=Weights(), window=48)
    assert decision is not None and decision.engine is a and decision.reason != "split_bound"
    one_more = [Candidate(E("a", 0), recent=36), Candidate(E("b", 1), recent=12)]
    guarded = choose_scored(one_more, weights=Weights(), window=48)
    assert guarded is not None and guarded.engine.id == "b" and guarded.reason == "split_bound"  # two in flight
