"""The metric formulas on hand-made timings, the SLO gate, percentiles."""

import math
import random

import numpy as np
import pytest

from loadtest.metrics import (
    describe,
    error_counts,
    is_good,
    itl_s,
    max_concurrency,
    per_turn,
    percentile,
    ratios,
    summarize,
    tpot_s,
)
from loadtest.records import RequestRecord
from loadtest.slo import SLOError, parse_slo, parse_slos, verdict


def record(sent, chunks, tokens, prompt=10, **kw):
    return RequestRecord(
        request_id=f"r{sent}",
        sent_s=sent,
        scheduled_s=kw.pop("scheduled", sent),
        ttft_s=chunks[0] if chunks else None,
        chunk_s=list(chunks),
        e2e_s=chunks[-1] if chunks else None,
        closed_s=(chunks[-1] + 0.001) if chunks else kw.pop("closed", 0.01),
        prompt_tokens=prompt,
        completion_tokens=tokens,
        status=200,
        done=True,
        **kw,
    )


def test_tpot_itl_and_e2e_follow_the_definitions():
    r = record(0.0, [0.100, 0.120, 0.150, 0.190], tokens=4)
    assert tpot_s(r) == pytest.approx((0.190 - 0.100) / 3)
    assert itl_s(r) == pytest.approx([0.020, 0.030, 0.040])
    assert tpot_s(record(0.0, [0.1], tokens=1)) is None


def test_tpot_uses_usage_tokens_not_chunks():
    # 2 chunks carrying 5 tokens (e.g. speculative decoding): TPOT and ITL differ
    r = record(0.0, [0.1, 0.5], tokens=5)
    assert tpot_s(r) == pytest.approx(0.4 / 4)
    assert itl_s(r) == pytest.approx([0.4])


def test_summary_throughput_goodput_and_errors():
    good = record(0.0, [0.1, 0.2, 0.3], tokens=3, prompt=100)
    slow = record(1.0, [0.9, 1.0], tokens=2, prompt=50)
    failed = RequestRecord(
        request_id="x",
        sent_s=0.25,
        scheduled_s=0.0,
        status=503,
        response_headers_s=0.01,
        closed_s=0.02,
        error_kind="http",
        error="HTTP 503: down",
    )
    summary = summarize([good, slow, failed], slos={"ttft": 0.5})
    # duration: first send 0.0 -> last end 1.0 + 1.001
    assert summary["duration"] == pytest.approx(2.001)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["request_throughput"] == pytest.approx(2 / 2.001)
    assert summary["output_throughput"] == pytest.approx(5 / 2.001)
    assert summary["total_token_throughput"] == pytest.approx(155 / 2.001)
    assert summary["good_requests"] == 1
    assert summary["request_goodput"] == pytest.approx(1 / 2.001)
    assert summary["slo_attainment"] == pytest.approx(1 / 3)  # errors count as misses
    assert summary["median_ttft_ms"] == pytest.approx(500)  # median of 100 and 900
    assert summary["mean_tpot_ms"] == pytest.approx((100 + 100) / 2)
    assert summary["p99_itl_ms"] == pytest.approx(np.percentile([100, 100, 100], 99))
    assert summary["errors"]["http"] == 1 and summary["errors"]["http_503"] == 1
    assert summary["errors"]["timeout"] == 0
    assert summary["max_lateness_ms"] == pytest.approx(250)
    assert summary["max_concurrent_requests"] == 2


def test_goodput_checks_every_slo_and_one_token_tpot_is_zero():
    r = record(0.0, [0.2, 0.3, 0.4], tokens=3)
    assert is_good(r, {"ttft": 0.25, "tpot": 0.11, "e2el": 0.5})
    assert not is_good(r, {"ttft": 0.25, "tpot": 0.09})
    assert not is_good(r, {"e2el": 0.39})
    assert is_good(record(0.0, [0.2], tokens=1), {"tpot": 0.001})


@pytest.mark.parametrize("seed", range(5))
def test_percentile_matches_numpy(seed):
    rng = random.Random(seed)
    values = [rng.expovariate(1.0) for _ in range(rng.randint(1, 50))]
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    stats = describe(values)
    assert stats["std"] == pytest.approx(float(np.std(values)))
    assert math.isnan(percentile([], 50))


def test_max_concurrency_is_a_sweep_line():
    records = [record(0.0, [1.0], 1), record(0.5, [1.0], 1), record(1.2, [0.1], 1)]
    assert max_concurrency(records) == 2


def test_per_turn_rows_and_kv_usage():
    a = record(0.0, [0.1, 0.2], 2, prompt=100, turn=0, engine={"vllm:kv_cache_usage_perc": 0.1})
    b = record(1.0, [0.3, 0.4], 2, prompt=300, turn=1, engine={"vllm:kv_cache_usage_perc": 0.3})
    c = RequestRecord(request_id="c", turn=1, error_kind="http", status=400)
    rows = per_turn([a, b, c])
    assert [row["turn"] for row in rows] == [0, 1]
    assert rows[1]["errors"] == 1 and rows[1]["requests"] == 2
    assert rows[1]["median_prompt_tokens"] == 300
    assert rows[1]["max_kv_cache_usage"] == pytest.approx(0.3)
    assert rows[0]["median_ttft_ms"] == pytest.approx(100)


def test_ratios_are_b_over_a():
    result = ratios({"median_ttft_ms": 100.0, "failed": 0}, {"median_ttft_ms": 250.0, "failed": 3})
    assert result["median_ttft_ms"] == pytest.approx(2.5)
    assert math.isnan(result["failed"])  # A is 0


def test_error_counts_list_every_kind():
    counts = error_counts([RequestRecord(request_id="t", error_kind="truncated")])
    assert counts["truncated"] == 1 and counts["stream_error"] == 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ttft:500ms", ("ttft", 0.5)),
        ("tpot:50", ("tpot", 0.05)),
        ("e2e:5s", ("e2el", 5.0)),
        ("E2EL: 1.5s", ("e2el", 1.5)),
        ("ttft:0.25s", ("ttft", 0.25)),
    ],
)
def test_parse_slo(text, expected):
    assert parse_slo(text) == expected


@pytest.mark.parametrize("text", ["ttft", "itl:5ms", "ttft:fast", "ttft:-5ms", ""])
def test_parse_slo_rejects_nonsense(text):
    with pytest.raises(SLOError):
        parse_slo(text)


def test_verdict_uses_the_required_attainment():
    assert parse_slos(["ttft:1s", "ttft:2s"]) == {"ttft": 2.0}
    assert verdict({"slo_attainment": 0.96}, 0.95)["passed"]
    assert not verdict({"slo_attainment": 0.94}, 0.95)["passed"]
    assert not verdict({"slo_attainment": float("nan")}, 0.5)["passed"]
