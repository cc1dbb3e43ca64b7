"""The cache-aware routing experiment's pieces that need no engine: the multi-tenant workload
(loadtest.tenants), the phases, the metric and access-log readers, and the goals' verdicts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from bench.routing_experiment import (
    DEFAULT_CONFIG,
    POLICIES,
    PhaseResult,
    build_parser,
    derived_config,
    judge,
    medians,
    metric_values,
    parse_weights,
    phases,
    report_markdown,
    router_argv,
    routing_counts,
)
from bench.routing_workloads import WORKLOADS, ordered_sessions
from loadtest.scenarios import ScenarioError
from loadtest.tenants import Workload, preamble, sessions, system_prompt, tenant_of


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_tenants_of_one_family_share_exactly_the_preamble_and_differ_after():
    workload = Workload(tenants=4, family_size=2, shared_chars=700, system_chars=1500)
    prompts = [system_prompt(workload, t) for t in range(4)]
    assert all(len(p) <= 1500 and len(p) > 1400 for p in prompts)
    shared = preamble(workload, 0)
    assert 630 <= len(shared) <= 700 and all(p.startswith(shared) for p in prompts[:2])  # family 0
    assert common_prefix(prompts[0], prompts[1]) < len(shared) + 20  # then each tenant's own text
    assert common_prefix(prompts[0], prompts[2]) < 100  # another family's preamble


def test_sessions_visit_every_tenant_before_any_tenant_comes_back():
    workload = Workload(tenants=3, family_size=3, conversations=2, turns=2, shared_chars=100, system_chars=400)
    conversations = sessions(workload)
    assert [tenant_of(s) for s in conversations] == [0, 1, 2, 0, 1, 2]
    assert sum(len(s.turns) for s in conversations) == workload.requests == 12
    assert all(s.max_tokens == (workload.max_tokens,) * 2 for s in conversations)
    assert conversations[0].prefix == conversations[3].prefix  # one system prompt per tenant
    assert conversations[0].turns != conversations[3].turns  # different conversations
    assert sessions(workload) == conversations  # deterministic


@pytest.mark.parametrize(
    "options", [{"tenants": 0}, {"turns": 0}, {"shared_chars": 500, "system_chars": 500}, {"shared_chars": -1}]
)
def test_a_workload_refuses_impossible_shapes(options: dict[str, int]) -> None:
    with pytest.raises(ScenarioError):
        Workload(**options)


def test_weights_are_parsed_and_checked_against_the_scorers():
    assert parse_weights("balance=0, prefix=2") == {"balance": 0.0, "prefix": 2.0}
    for bad in ("balance", "nosuch=1", "balance=-1", "balance=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_weights(bad)


def test_weight_variants_run_the_chosen_index_with_the_defaults_overridden():
    todo = phases(["round_robin", "oracle"], [{"balance": 0.0}], "precise")
    assert [p.label for p in todo] == ["round_robin", "oracle", "precise[balance=0]"]
    assert todo[1].routing is None
    variant = todo[2].routing
    assert variant is not None and variant["prefix_index"] == "precise" and variant["weights"]["balance"] == 0.0
    assert variant["weights"]["prefix"] == 1.0  # the other weights stay the defaults
    assert POLICIES["today"] == {"policy": "least_outstanding", "prefix_affinity": True, "prefix_chars": 1024}


def test_the_derived_config_keeps_the_engines_and_changes_only_routing(tmp_path: Path) -> None:
    path = derived_config(
        DEFAULT_CONFIG, tmp_path, "x", {"policy": "round_robin"}, port=9999, base_port=8300, trimming="off"
    )
    data = yaml.safe_load(path.read_text())
    assert data["models"][0]["trimming"] == {"mode": "off"}
    profile = Path(data["models"][0]["profile"])
    assert profile.is_absolute() and profile.exists()
    assert data["models"][0]["base_port"] == 8300 and data["port"] == 9999
    assert data["routing"]["policy"] == "round_robin"
    assert data["routing"]["prefix_index"] == "precise"  # the config's own routing keys stay


def test_metric_values_sum_every_labelled_sample_of_one_name_only():
    text = (
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 3.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="tiny"} 4.0\n'
        "vllm:request_success_created 1.7e9\n"
        "vllm:prefix_cache_hits_total 256.0\n"
    )
    assert sum(metric_values(text, "vllm:request_success_total").values()) == 7.0
    assert metric_values(text, "vllm:prefix_cache_hits_total") == {"": 256.0}
    assert metric_values(text, "vllm:prefix_cache_queries_total") == {}


def test_routing_counts_read_the_access_log(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    lines = [
        {"logger": "gateway", "msg": "gateway on http://127.0.0.1:1/v1"},
        {"logger": "gateway.access", "routing": {"reason": "prefix", "source": "precise"}},
        {"logger": "gateway.access", "routing": {"reason": "prefix", "source": "precise"}},
        {"logger": "gateway.access", "routing": {"reason": "round_robin"}},
    ]
    log.write_text("\n".join(json.dumps(line) for line in lines) + '\nnot json "routing"\n')
    assert routing_counts(log) == ({"prefix": 2, "round_robin": 1}, {"precise": 2, "none": 1})


def result(label: str, share: float, p90: float, split: tuple[int, int], base: str | None = None) -> PhaseResult:
    out = PhaseResult(label, base or label, 1, prompt_tokens=1000, cached_tokens=round(share * 1000))
    out.ttft_p90_s = p90
    out.split = {"a": split[0], "b": split[1]}
    return out


def test_the_goals_compare_each_cache_aware_run_with_its_rounds_baselines():
    results = [
        result("round_robin", 0.40, 2.0, (50, 50)),
        result("today", 0.45, 3.0, (100, 0)),
        result("router_cache_aware", 0.72, 1.2, (60, 40)),
        result("router_kv_aware", 0.74, 1.1, (55, 45)),
        result("oracle", 0.80, 1.0, (50, 50)),
        result("precise", 0.76, 1.5, (55, 45)),
        result("approximate", 0.70, 2.5, (70, 30)),
    ]
    goals = judge(results)
    precise, approximate = goals["tenants: precise (round 1)"], goals["tenants: approximate (round 1)"]
    assert precise["share_at_least_0.9_oracle"] and precise["ttft_p90_no_worse_than_round_robin"]
    assert precise["imbalance_at_most_1.5"] and precise["share_vs_oracle"] == pytest.approx(0.95)
    assert precise["best_router"] == "router_kv_aware" and precise["share_at_least_best_router"]
    assert precise["share_vs_best_router"] == pytest.approx(0.76 / 0.74)
    assert not approximate["share_at_least_0.9_oracle"] and not approximate["ttft_p90_no_worse_than_round_robin"]
    assert not approximate["imbalance_at_most_1.5"] and not approximate["share_at_least_best_router"]
    assert results[1].imbalance == float("inf")
    assert set(goals) == {"tenants: precise (round 1)", "tenants: approximate (round 1)"}


def test_every_workload_and_round_is_judged_apart_and_medians_cover_every_round():
    results = []
    for round_, share in ((1, 0.6), (2, 0.7), (3, 0.65)):
        for workload in ("tenants", "hot-prefix"):
            for label, value in (("oracle", 0.7), ("precise", share)):
                r = result(label, value, 1.0, (48, 48))
                r.round, r.workload = round_, workload
                results.append(r)
    goals = judge(results)
    assert len(goals) == 6 and "hot-prefix: precise (round 2)" in goals
    rows = {(row["workload"], row["label"]): row for row in medians(results)}
    precise = rows[("hot-prefix", "precise")]["hit_share"]
    assert precise["median"] == pytest.approx(0.65) and precise["min"] == pytest.approx(0.6)
    assert precise["max"] == pytest.approx(0.7) and rows[("hot-prefix", "precise")]["runs"] == 3
    text = report_markdown(results, {**META, "workloads": {}}, goals)
    assert "| hot-prefix | precise | 3 | 0.650 (0.600-0.700) |" in text


META = {
    "started": "now", "host": "h", "cpus": 2, "load_before": "0", "load_after": "0", "command": "c",
    "gateway_code": "abc", "trimming": "off", "engines": ["a", "b"], "profile": "p",
}  # fmt: skip


def test_vllm_router_runs_each_policy_and_kv_aware_reads_every_engines_events():
    engines = ["http://127.0.0.1:8170", "http://127.0.0.1:8171"]
    cache_aware = router_argv("cache_aware", 9000, engines)
    assert cache_aware[cache_aware.index("--policy") + 1] == "cache_aware" and "--kv-event-source" not in cache_aware
    assert cache_aware[cache_aware.index("--worker-urls") + 1 : cache_aware.index("--policy")] == engines
    kv = router_argv("kv_aware", 9000, engines, "/models/tiny")
    sources = [kv[i + 1] for i, arg in enumerate(kv) if arg == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:8170=tcp://127.0.0.1:18170", "http://127.0.0.1:8171=tcp://127.0.0.1:18171"]
    assert kv[kv.index("--kv-event-block-size") + 1] == "128" and kv[kv.index("--kv-event-model") + 1] == "/models/tiny"


def test_the_hot_prefix_workload_is_issue_34s_and_shuffled_the_same_way_each_time():
    spec = WORKLOADS["hot-prefix"]
    conversations = ordered_sessions(spec)
    assert len(conversations) == spec.workload.requests == 96 and spec.concurrency == 2
    assert all(len(s.turns) == 1 for s in conversations)
    assert sorted(tenant_of(s) for s in conversations) == sorted(list(range(24)) * 4)
    assert [tenant_of(s) for s in conversations[:24]] != list(range(24))  # shuffled
    assert ordered_sessions(spec) == conversations
    prompts = {s.prefix[0]["content"] for s in conversations}
    assert len(prompts) == 24 and len({p[:1200] for p in prompts}) == 1  # one house-rules opening
    assert ordered_sessions(WORKLOADS["tenants"]) == sessions(Workload())  # the experiment's own, as before


def test_the_command_line_has_the_workload_options():
    args = build_parser().parse_args(["--tenants", "3", "--weights", "balance=1", "--rounds", "2"])
    assert args.tenants == 3 and args.weights == [{"balance": 1.0}] and args.rounds == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weights", "balance=-1"])


def test_before_adds_each_cache_aware_policy_again_with_that_commits_gateway_right_after_it():
    todo = phases(["round_robin", "approximate", "precise", "oracle"], [], "precise", "abc1234")
    assert [p.label for p in todo] == [
        "round_robin", "approximate", "approximate@abc1234", "precise", "precise@abc1234", "oracle"
    ]  # fmt: skip
    assert todo[2].base == "approximate" and todo[2].code == "abc1234" and todo[1].code is None
    assert todo[2].routing == todo[1].routing


def test_each_request_row_carries_its_gateway_decision_or_the_oracles_route(tmp_path: Path) -> None:
    from bench.routing_experiment import request_rows, routing_decisions
    from loadtest.records import RequestRecord

    log = tmp_path / "gateway.log"
    decision = {"engine": "127.0.0.1:8110", "reason": "wait", "matched": {"127.0.0.1:8110": 4}}
    log.write_text(
        json.dumps({"request_id": "r1", "routing": decision}) + "\n"
        + json.dumps({"request_id": "r2", "routing": None}) + "\nnot json with \"routing\"\n"
    )  # fmt: skip
    decisions = routing_decisions(log)
    assert decisions == {"r1": decision}
    sent = RequestRecord("r1", session_id="tenant-3-conversation-0", sent_s=1.0, ttft_s=0.02, closed_s=0.05)
    sent.prompt_tokens, sent.cached_tokens = 1459, 512
    oracle = RequestRecord("r9", session_id="tenant-3-conversation-1", sent_s=2.0, ttft_s=0.03)
    engines = ["http://127.0.0.1:8110", "http://127.0.0.1:8111"]
    rows = request_rows([sent, oracle], {"tenant-3-conversation-0": 3, "tenant-3-conversation-1": 3}, decisions,
                        {3: "http://127.0.0.1:8111"}, engines)  # fmt: skip
    assert rows[0]["engine"] == "127.0.0.1:8110" and rows[0]["routing"] == decision  # the gateway's own word
    assert rows[0]["end_s"] == 1.05 and rows[0]["cached_tokens"] == 512 and rows[0]["tenant"] == 3
    assert rows[1]["engine"] == "127.0.0.1:8111" and rows[1]["routing"] is None  # the oracle sent it there
    through_gateway = request_rows([oracle], {"tenant-3-conversation-1": 3}, {}, {3: "http://127.0.0.1:9000"}, engines)
    assert through_gateway[0]["engine"] is None  # a gateway's URL is not a replica
