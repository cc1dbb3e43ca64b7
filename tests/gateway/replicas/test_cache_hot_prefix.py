"""What cache.py tells the scorer beyond matches (issue 34): which leading blocks of a prompt are a
hot shared prefix (PrefixTraffic), and how much pressure each replica's cache is under."""

from __future__ import annotations

from server.gateway.replicas.blocks import text_blocks, token_blocks
from server.gateway.replicas.cache import EVICTING_SECONDS, CacheState, PrefixTraffic, PromptView
from server.gateway.replicas.engine import Engine, EngineMetrics

RULES = "house rules " * 60  # 720 characters every tenant's prompt opens with


def keys(text: str) -> list[int]:
    return text_blocks(text, 64)


def tenant(n: int) -> str:
    return RULES + f"{n}: tenant catalogue " * 20


def test_a_prefix_more_than_one_replicas_share_of_prompts_carried_is_hot():
    traffic = PrefixTraffic(window=64)
    shared = len(keys(RULES))
    assert traffic.hot(keys(tenant(0)), 2) == 0  # nothing seen yet
    traffic.add([keys(tenant(0))])
    assert traffic.hot(keys(tenant(1)), 2) == 0  # seen once: no evidence it is shared
    traffic.add([keys(tenant(1))])
    traffic.add([keys(tenant(2))])
    assert traffic.hot(keys(tenant(3)), 2) == shared  # every prompt carried the rules, not the rest
    assert traffic.hot(keys(tenant(0)), 2) == shared  # tenant 0's own blocks: 1 prompt of 3
    assert traffic.hot(keys(tenant(0)), 1) == 0  # one replica: nothing to spread


def test_a_tenants_own_blocks_are_not_hot_unless_it_sends_most_of_the_traffic():
    traffic = PrefixTraffic(window=64)
    for n in range(12):  # 12 tenants, 4 prompts each: each tenant 1/12 of the traffic
        for _ in range(4):
            traffic.add([keys(tenant(n))])
    assert traffic.hot(keys(tenant(5)), 2) == len(keys(RULES))
    busy = PrefixTraffic(window=8)
    for _ in range(8):
        busy.add([keys(tenant(0))])
    assert busy.hot(keys(tenant(0)), 2) == len(keys(tenant(0)))  # one tenant is all of it: hot all through


def test_the_window_forgets_old_prompts():
    traffic = PrefixTraffic(window=4)
    for _ in range(4):
        traffic.add([keys(tenant(0))])
    for n in range(1, 5):
        traffic.add([keys("other " * 40 + str(n))])
    assert traffic.hot(keys(tenant(1)), 2) == 0
    assert len(traffic._counts) <= 4 * len(keys("other " * 40 + "1")) + 4


def test_sent_prompts_feed_the_traffic_in_both_kinds_of_blocks():
    cache = CacheState(block_chars=64)
    a, b = Engine("m", "http://a"), Engine("m", "http://b")
    for engine in (a, b):
        cache.precise.set_live(engine.id, True)
        cache.precise.state(engine.id).block_size = 4
    for n in range(3):
        text = tenant(n)
        view = PromptView(keys(text), len(text), tokens=[ord(c) for c in text])
        cache.sent(a, view, now=0.0)
    text = tenant(9)
    view = PromptView(keys(text), len(text), tokens=[ord(c) for c in text])
    assert cache.hot_blocks([a, b], view, "approximate") == len(keys(RULES))
    assert cache.hot_blocks([a, b], view, "precise") == len(token_blocks([ord(c) for c in RULES], 4))
    assert cache.hot_blocks([a, b], None, "precise") == 0 and cache.hot_blocks([a, b], view, "none") == 0


def test_a_cache_that_just_evicted_is_under_full_pressure_until_it_stops():
    cache = CacheState()
    engine = Engine("m", "http://a")
    engine.record_scrape(EngineMetrics(kv_capacity_tokens=48 * 128, kv_usage=0.1, block_size=128), at=0.0)
    view = PromptView([], 0, tokens=list(range(128 * 4)))
    cache.precise.set_live(engine.id, True)
    cache.precise.stored(engine.id, block_hashes=[1, 2, 3], parent=None, token_ids=list(range(128 * 3)), block_size=128)
    _, _, (candidate,) = cache.candidates([engine], view, 0.0, precise=True)
    assert candidate.held == 3 and candidate.pressure == 0.1  # usage above 3 of 48 blocks
    cache.precise.removed(engine.id, [3])
    _, _, (candidate,) = cache.candidates([engine], view, 1.0, precise=True)
    assert candidate.pressure == 1.0  # a BlockRemoved since the last look: evicting
    _, _, (candidate,) = cache.candidates([engine], view, 1.0 + EVICTING_SECONDS / 2, precise=True)
    assert candidate.pressure == 1.0
    _, _, (candidate,) = cache.candidates([engine], view, 2.0 + EVICTING_SECONDS, precise=True)
    assert candidate.pressure == 0.1  # no removal for a while


def test_the_approximate_pressure_is_its_record_over_its_capacity():
    cache = CacheState(block_chars=16)
    engine = Engine("m", "http://a")
    cache.approximate.set_capacity(engine.id, 10)
    cache.approximate.record(engine.id, list(range(5)), 0.0)
    view = PromptView(list(range(3)), 48)
    _, _, (candidate,) = cache.candidates([engine], view, 0.0, precise=False)
    assert candidate.held == 5 and candidate.pressure == 0.5
    cache.approximate.record(engine.id, list(range(100, 120)), 0.0)
    _, _, (candidate,) = cache.candidates([engine], view, 0.0, precise=False)
    assert candidate.pressure == 1.0  # full: its LRU evicts
