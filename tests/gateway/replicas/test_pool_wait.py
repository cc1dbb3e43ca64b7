"""The pool's part in the wait rule: each replica's requests in flight (sent, computed tokens),
given back on release, and the waits and block costs it hands the scorer. No I/O."""

from __future__ import annotations

from server.config import ServedModel
from server.gateway.replicas.cache import PromptView
from server.gateway.replicas.engine import EngineMetrics
from server.gateway.replicas.pool import EnginePool, ModelPool
from server.gateway.settings import Routing

# An engine that has computed 12,000 prompt tokens in 0.3 s of prefill: 25 us a token, 3.2 ms a
# block of 128; 40 requests to their first token in 1.0 s in all.
KNOWN = EngineMetrics(
    kv_usage=0.0,
    prefix_queries_tokens=20_000,
    prefix_hits_tokens=8_000,
    prefill_seconds=0.3,
    first_token_seconds=1.0,
    first_tokens=40,
    block_size=128,
)


class Clock:
    """The pool's clock, moved by hand: no test here reads the machine's."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def two_replicas(metrics: EngineMetrics = KNOWN) -> ModelPool:
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1", "http://b:1"])]).get("m")
    pool.clock = Clock()
    for engine in pool.engines:
        engine.metrics = metrics
        pool.cache.precise.set_live(engine.id, True)
        pool.cache.precise.state(engine.id).block_size = 128
    return pool


def prompt(tokens: int = 1280) -> PromptView:
    return PromptView([1, 2, 3], 600, tokens=list(range(tokens)))


def test_a_request_in_flight_is_work_the_next_one_would_wait_behind():
    pool = two_replicas()
    routing = Routing(prefix_index="precise")
    first = pool.route(routing, prompt=prompt())
    assert first is not None
    # The same prompt again at once: its 10 blocks are held (speculatively) where the first went,
    # but that replica is still prefilling them; the other is idle and the saving (10 blocks, 32 ms)
    # outweighs what is left of the first request's work (about 17.5 ms + 32 ms, less a moment).
    assert isinstance(pool.clock, Clock)
    pool.clock.now += 0.005  # 5 ms later
    second = pool.route(routing, prompt=prompt())
    assert second is not None
    other = next(e for e in pool.engines if e is not first.engine)
    assert second.explain()["wait_ms"] == {first.engine.id: 44.5, other.id: 0.0}  # 17.5 + 32 ms, less 5
    assert second.engine is other and second.reason == "wait"


def test_once_the_request_in_flight_is_past_its_first_token_its_blocks_win():
    pool = two_replicas()
    routing = Routing(prefix_index="precise")
    first = pool.route(routing, prompt=prompt())
    assert first is not None and isinstance(pool.clock, Clock)
    pool.clock.now += 0.060  # past its expected first token (49.5 ms): decoding, which a newcomer runs beside
    second = pool.route(routing, prompt=prompt())
    assert second is not None and second.engine is first.engine and second.reason == "prefix"
    assert "wait_ms" not in second.explain()  # no work left before a first token anywhere


def test_release_gives_the_work_back_and_an_idle_pool_waits_for_nothing():
    pool = two_replicas()
    routing = Routing(prefix_index="precise")
    decisions = [pool.route(routing, prompt=prompt()) for _ in range(2)]
    for decision in decisions:
        assert decision is not None
        pool.release(decision.engine)
    assert all(len(pool._inflight_of(e)) == 0 and e.outstanding == 0 for e in pool.engines)
    third = pool.route(routing, prompt=prompt())
    assert third is not None and "wait_ms" not in third.explain() and third.reason == "tie"  # both hold it now


def test_while_the_engines_costs_are_unknown_the_scores_decide_as_before():
    pool = two_replicas(EngineMetrics(kv_usage=0.0, block_size=128))
    routing = Routing(prefix_index="precise")
    first = pool.route(routing, prompt=prompt())
    second = pool.route(routing, prompt=prompt())
    assert first is not None and second is not None
    assert second.engine is first.engine and second.reason == "prefix"  # the burst stays together


def test_other_policies_count_their_requests_in_flight_too():
    pool = two_replicas()
    routing = Routing(policy="round_robin", prefix_affinity=False)
    decision = pool.route(routing)
    assert decision is not None and len(pool._inflight_of(decision.engine)) == 1
    pool.release(decision.engine)
    assert len(pool._inflight_of(decision.engine)) == 0
