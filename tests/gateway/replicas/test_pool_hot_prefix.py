"""The pool's cache_aware routing over whole workloads, with the engines modelled (no I/O): issue
34's hot-prefix workload and the experiment's own, both indexes. The real engines' figures come
from bench/routing_experiment.py; these say the pool's decisions (window, traffic, pressure) fit
together: the split within 1.5x at two requests in flight and the hit share near the oracle's."""

from __future__ import annotations

import pytest

from bench.routing_simulation import oracle, simulate
from server.config import ServedModel
from server.gateway.replicas.cache import PromptView
from server.gateway.replicas.pool import EnginePool
from server.gateway.settings import Routing


@pytest.mark.parametrize("workload", ["hot-prefix", "tenants"])
@pytest.mark.parametrize("index", ["approximate", "precise"])
@pytest.mark.parametrize("lag", [False, True])
def test_the_split_stays_even_and_the_hits_near_the_oracles(workload: str, index: str, lag: bool) -> None:
    for seed in range(2):
        concurrency = 2 if workload == "hot-prefix" else 4
        out = simulate(workload, index, blocks=48, block_tokens=128, concurrency=concurrency, seed=seed, lag=lag)
        best = oracle(workload, blocks=48, block_tokens=128, seed=seed)
        assert out["requests"] == 96
        assert max(out["split"]) <= 1.5 * min(out["split"]), out
        assert out["hit_share"] >= 0.9 * best["hit_share"], (out, best)


def test_the_window_counts_the_models_last_decisions():
    pool = EnginePool.from_models([ServedModel("m", ["http://a:1", "http://b:1"])]).get("m")
    policy = Routing(share_window=4)
    for n in range(10):
        decision = pool.route(policy, prompt=PromptView([n], 16))
        assert decision is not None
        pool.release(decision.engine)
    assert len(pool._recent) == 4 and set(pool._recent) <= {"a:1", "b:1"}
    none = Routing(share_window=0)
    decision = pool.route(none, prompt=PromptView([1], 16))
    assert decision is not None and len(pool._recent) == 0  # 0: no window, no guard
