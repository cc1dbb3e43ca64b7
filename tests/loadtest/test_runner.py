"""Load shapes and stop rules against the real stand-in server."""

import itertools

import httpx
import pytest

from loadtest import scenarios
from loadtest.client import ChatClient, make_http_client
from loadtest.engine_probe import EngineProbe, counter_deltas, parse_metrics
from loadtest.runner import LoadShape, Runner, StopRule


async def run(url, sessions, shape, stop, **kw):
    async with make_http_client(max_connections=16, timeout_s=10) as http:
        client = ChatClient(url, http=http, model="standin", timeout_s=10)
        probe = EngineProbe(url + "/metrics", http=http) if kw.pop("probe", False) else None
        return await Runner(client, sessions, shape, stop, probe=probe, **kw).run()


async def test_itinerary_history_grows_turn_by_turn(standin):
    sessions = scenarios.itinerary(0, turns=4, max_tokens=6)
    result = await run(standin, sessions, LoadShape(concurrency=2), StopRule(num_requests=8))
    assert len(result.records) == 8 and all(r.ok for r in result.records)
    by_session = {}
    for record in result.records:
        by_session.setdefault(record.session_id, []).append(record)
    assert len(by_session) == 2
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        # system + history (user, assistant per finished turn) + the new user turn
        assert [r.prompt_messages for r in turns] == [2, 4, 6, 8]
        chars = [r.prompt_chars for r in turns]
        tokens = [r.prompt_tokens for r in turns]
        assert chars == sorted(chars) and len(set(chars)) == 4
        assert tokens == sorted(tokens) and len(set(tokens)) == 4
        # the next turn left only after the previous answer was complete
        for earlier, later in zip(turns, turns[1:]):
            assert later.sent_s >= earlier.sent_s + earlier.e2e_s


async def test_closed_loop_never_exceeds_its_concurrency(standin):
    sessions = scenarios.random_prompts(0, input_chars=50, max_tokens=4)
    result = await run(standin, sessions, LoadShape(concurrency=3), StopRule(num_requests=12, warmup_requests=3))
    stats = httpx.get(f"{standin}/_standin/stats").json()
    assert stats["peak_running"] == 3 and stats["finished"] == 15
    assert len(result.records) == 15 and len(result.measured) == 12
    assert [r.phase for r in result.records[:3]] == ["warmup"] * 3


async def test_open_loop_rate_ceiling_and_lateness(standin):
    sessions = scenarios.random_prompts(0, input_chars=50, max_tokens=4)
    # 40 req/s arrivals, each ~50 ms long, at most 1 in flight: requests must queue
    result = await run(
        standin, sessions, LoadShape(concurrency=1, rate=40, arrival="constant"), StopRule(num_requests=10)
    )
    stats = httpx.get(f"{standin}/_standin/stats").json()
    assert stats["peak_running"] == 1
    assert [round(r.scheduled_s, 3) for r in result.records] == [round(i / 40, 3) for i in range(10)]
    assert result.records[-1].lateness_s > 0.1  # waited for the ceiling
    free = await run(
        standin,
        scenarios.random_prompts(1, input_chars=50, max_tokens=4),
        LoadShape(rate=40, arrival="constant"),
        StopRule(num_requests=10),
    )
    assert max(r.lateness_s for r in free.records) < 0.05
    assert httpx.get(f"{standin}/_standin/stats").json()["peak_running"] > 1


async def test_duration_stop(standin):
    sessions = scenarios.random_prompts(0, input_chars=50, max_tokens=4)
    result = await run(standin, sessions, LoadShape(concurrency=2), StopRule(duration_s=0.5))
    measured = result.measured
    assert 6 <= len(measured) <= 40
    assert max(r.sent_s for r in measured) - min(r.sent_s for r in measured) < 0.5


async def test_failed_turns_stay_out_of_the_history(standin):
    httpx.post(f"{standin}/_standin/faults", json={"status": 500, "times": 1})
    sessions = scenarios.itinerary(0, turns=3, max_tokens=4)
    result = await run(standin, sessions, LoadShape(concurrency=1), StopRule(num_requests=3))
    assert [r.ok for r in result.records] == [False, True, True]
    assert [r.prompt_messages for r in result.records] == [2, 2, 4]
    httpx.post(f"{standin}/_standin/faults", json={"status": 500, "times": 1})
    ended = await run(
        standin,
        scenarios.itinerary(0, turns=3, max_tokens=4),
        LoadShape(concurrency=1),
        StopRule(num_requests=3),
        end_session_on_error=True,
    )
    assert [r.turn for r in ended.records] == [0, 0, 1]  # the failed session was abandoned
    assert len({r.session_id for r in ended.records}) == 2


async def test_finite_scenario_ends_the_run(standin):
    sessions = list(itertools.islice(scenarios.articles(0, num_prompts=5, max_tokens=4), 5))
    result = await run(standin, sessions, LoadShape(concurrency=4), StopRule(num_requests=50))
    assert len(result.records) == 5


async def test_engine_probe_per_request_and_counter_deltas(standin):
    httpx.post(f"{standin}/_standin/faults", json={"kv_cache_usage_perc": 0.42})
    sessions = scenarios.articles(0, num_prompts=4, max_tokens=4)
    result = await run(standin, sessions, LoadShape(concurrency=2), StopRule(num_requests=4), probe=True)
    assert all(r.engine["vllm:kv_cache_usage_perc"] == pytest.approx(0.42) for r in result.records)
    assert result.engine["prefix_cache_queries_total"] > 0
    assert 0 <= result.engine["prefix_cache_hit_rate"] <= 1


def test_parse_metrics_text():
    text = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="a b"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="a b"} 40.0
vllm:prefix_cache_hits_created 1.7e9
vllm:num_requests_waiting NaN
"""
    values = parse_metrics(text)
    assert values["vllm:kv_cache_usage_perc"] == 0.5
    assert values["vllm:num_requests_running"] == 3.0
    assert values["vllm:prefix_cache_queries_total"] == 100.0
    assert "vllm:num_requests_waiting" not in values
    before = {"vllm:prefix_cache_queries_total": 60.0, "vllm:prefix_cache_hits_total": 10.0}
    deltas = counter_deltas(before, values)
    assert deltas["prefix_cache_hit_rate"] == pytest.approx(30 / 40)


def test_each_request_gets_the_highest_sample_while_it_was_in_flight():
    from loadtest.engine_probe import Sample, during

    samples = [
        Sample(0.0, 0.01, {"vllm:kv_cache_usage_perc": 0.1}),
        Sample(0.10, 0.11, {"vllm:kv_cache_usage_perc": 0.3}),
        Sample(0.20, 0.21, {"vllm:kv_cache_usage_perc": 0.2}),
    ]
    assert during(samples, 0.05, 0.25)["vllm:kv_cache_usage_perc"] == 0.3
    assert during(samples, 0.15, 0.25)["vllm:kv_cache_usage_perc"] == 0.2
    assert during(samples, 0.012, 0.09) is None


async def test_paired_run_sends_every_turn_to_both_targets_back_to_back(standin):
    from loadtest.runner import Target

    async with make_http_client(max_connections=4, timeout_s=10) as http:
        a = ChatClient(standin, http=http, model="standin", timeout_s=10)
        b = ChatClient(standin + "/v1", http=http, model="standin", timeout_s=10, headers={"x-variant": "b"})
        runner = Runner(
            a,
            scenarios.itinerary(0, turns=3, max_tokens=4),
            LoadShape(concurrency=1),
            StopRule(num_requests=6),
            target="A",
            paired_with=Target("B", b),
        )
        result_a, result_b = await runner.run_all()
    assert len(result_a.records) == len(result_b.records) == 6
    merged = sorted(result_a.records + result_b.records, key=lambda r: r.sent_s)
    # session 0: A first, session 1: B first; each turn on both before the next turn
    assert [r.target for r in merged] == ["A", "B"] * 3 + ["B", "A"] * 3
    assert [(r.session_id, r.turn) for r in merged[::2]] == [(r.session_id, r.turn) for r in merged[1::2]]
    # separate histories, equally long
    assert [r.prompt_messages for r in result_a.records] == [2, 4, 6] * 2
    assert [r.prompt_messages for r in result_b.records] == [2, 4, 6] * 2


def test_paired_differences_match_prompts():
    from loadtest.metrics import paired_differences
    from loadtest.records import RequestRecord

    def rec(target, session, turn, ttft, e2e, ok=True):
        return RequestRecord(
            request_id=f"{target}{session}{turn}",
            target=target,
            session_id=session,
            turn=turn,
            ttft_s=ttft,
            e2e_s=e2e,
            error_kind=None if ok else "http",
        )

    a = [rec("A", "s", 0, 0.100, 0.200), rec("A", "s", 1, 0.300, 0.400), rec("A", "t", 0, 0.5, 0.6, ok=False)]
    b = [rec("B", "s", 1, 0.302, 0.410), rec("B", "s", 0, 0.101, 0.201), rec("B", "t", 0, 0.1, 0.1)]
    diffs = paired_differences(a, b)
    assert diffs["pairs"] == 2
    assert diffs["median_ttft_diff_ms"] == pytest.approx(1.5)
    assert diffs["mean_e2el_diff_ms"] == pytest.approx(5.5)


def test_balanced_difference_cancels_the_advantage_of_going_second():
    from loadtest.metrics import paired_differences
    from loadtest.records import RequestRecord

    a, b = [], []
    # true overhead of B: +2 ms; whoever goes second is 10 ms faster (prefix cache)
    for i in range(10):
        a_first = i < 6  # unbalanced on purpose
        ta = 0.050 - (0 if a_first else 0.010)
        tb = 0.052 - (0.010 if a_first else 0)
        a.append(
            RequestRecord(request_id=f"a{i}", session_id=str(i), sent_s=0.0 if a_first else 1, ttft_s=ta, e2e_s=ta)
        )
        b.append(
            RequestRecord(request_id=f"b{i}", session_id=str(i), sent_s=1 if a_first else 0.0, ttft_s=tb, e2e_s=tb)
        )
    diffs = paired_differences(a, b)
    assert diffs["balanced_ttft_diff_ms"] == pytest.approx(2.0)
    assert diffs["median_ttft_diff_ms"] != pytest.approx(2.0)  # the plain median is fooled
