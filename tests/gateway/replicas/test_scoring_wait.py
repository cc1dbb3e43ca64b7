"""The wait rule (issue 34's TTFT goal), on made-up states, pure: a request does not wait behind
another on one replica while another replica is idle, unless what the busy replica's cache saves
outweighs the wait, both in seconds."""

from __future__ import annotations

import pytest

from server.gateway.replicas.scoring import Candidate, Weights, choose_scored, worth_the_wait
from tests.gateway.replicas.made_up import E

# The tiny model on one core (run k's engines): about 2.4 ms to compute a block of 128 tokens.
BLOCK_S = 0.0024
SHARED, OWN = 4, 7
PROMPT = SHARED + OWN


def test_a_cache_saving_must_outweigh_the_wait():
    busy, idle = E("busy", 1), E("idle")
    home = Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.010)
    away = Candidate(idle, SHARED, 40, block_seconds=BLOCK_S)
    assert worth_the_wait(home, away)  # 7 blocks save 16.8 ms against 10 ms still ahead
    assert not worth_the_wait(Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.020), away)
    assert not worth_the_wait(Candidate(busy, SHARED, 40, block_seconds=BLOCK_S, wait=0.0), away)  # saves nothing
    assert not worth_the_wait(Candidate(busy, PROMPT, 40, block_seconds=0.0, wait=0.0), away)  # nothing known


def test_a_returning_tenant_waits_for_its_blocks_only_when_they_save_more_than_the_wait():
    busy, idle = E("home", 1), E("idle")
    # Its own blocks are at home, where another request is in flight; the other replica is idle.
    soon_done = [Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.004), Candidate(idle, SHARED, 40)]
    kept = choose_scored(soon_done, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert kept is not None and kept.engine is busy and kept.reason == "prefix"
    just_sent = [Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.030), Candidate(idle, SHARED, 40)]
    moved = choose_scored(just_sent, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert moved is not None and moved.engine is idle and moved.reason == "wait"
    assert moved.explain()["wait_ms"] == {"home": 30.0, "idle": 0.0}


def test_a_lead_that_saves_nothing_never_sends_a_request_behind_another():
    """Issue 34's quiet runs at the code before: a `balance`, `kv_usage` or `spread` lead sent
    requests to the busy replica with the other idle, for no cache saving at all."""
    busy, idle = E("busy", 1, kv_usage=0.1), E("idle", kv_usage=0.9)
    candidates = [
        Candidate(busy, SHARED, 10, block_seconds=BLOCK_S),
        Candidate(idle, SHARED, 40, block_seconds=BLOCK_S),
    ]
    scored = choose_scored(candidates, weights=Weights(outstanding=0), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert scored is not None and scored.engine is idle and scored.reason == "wait"
    # Even behind a request that is decoding (no wait left): equal caches, so the idle one.
    decoding = [Candidate(busy, SHARED, 10, block_seconds=BLOCK_S, wait=0.0), Candidate(idle, SHARED, 40)]
    assert (d := choose_scored(decoding, weights=Weights(outstanding=0), prompt_blocks=PROMPT)) is not None
    assert d.engine is idle and d.reason == "wait"
    # Without the rule's figures (costs unknown) the scores decide, as before.
    unknown = [Candidate(busy, SHARED, 10), Candidate(idle, SHARED, 40)]
    before = choose_scored(unknown, weights=Weights(outstanding=0), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert before is not None and before.engine is busy


def test_the_rule_needs_an_idle_replica_and_leaves_sessions_alone():
    a, b = E("a", 2), E("b", 1)
    # Both busy: the scores decide (at high concurrency the load scores and the bound do).
    both = [Candidate(a, PROMPT, 40, block_seconds=BLOCK_S, wait=0.5), Candidate(b, SHARED, 40, block_seconds=BLOCK_S)]
    decision = choose_scored(both, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.engine is a and decision.reason == "prefix"
    busy, idle = E("busy", 1), E("idle")
    pinned = [Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.5), Candidate(idle, SHARED, 40)]
    session = choose_scored(pinned, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED, preferred=busy)
    assert session is not None and session.engine is busy  # a session keeps its replica (load bound only)


def test_an_idle_winner_is_never_moved():
    idle, busy = E("idle"), E("busy", 1)
    candidates = [Candidate(idle, PROMPT, 40, block_seconds=BLOCK_S), Candidate(busy, SHARED, 40, wait=1.0)]
    decision = choose_scored(candidates, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.engine is idle and decision.reason == "prefix"
    assert "wait_ms" in decision.explain()


@pytest.mark.parametrize("idle_matched", [0, PROMPT - 2])
def test_the_idle_replica_taken_is_the_best_scoring_one(idle_matched: int) -> None:
    busy, cold, warm = E("busy", 1), E("cold"), E("warm")
    candidates = [
        Candidate(busy, PROMPT, 40, block_seconds=BLOCK_S, wait=0.5),
        Candidate(cold, 0, 0),
        Candidate(warm, idle_matched, 20),
    ]
    decision = choose_scored(candidates, weights=Weights(), prompt_blocks=PROMPT, hot_blocks=SHARED)
    assert decision is not None and decision.reason == "wait"
    assert decision.engine is (warm if idle_matched else cold)  # more of its own blocks, or else the emptier cache
