"""The benchmark's own parts count what they claim: load generator, process CPU, figures, goals."""

from __future__ import annotations

import os

import httpx

from bench.loadgen import run_load, summarize
from bench.proctree import tree_cpu_seconds, tree_cpu_split, tree_pids
from bench.proxy_bench import figures, judge
from standin import StandinConfig, build_app
from tests.support import serve_in_thread

CHUNKS_PER_ANSWER = 1 + 4 + 1  # role, 4 tokens, usage ([DONE] is not counted)


async def test_load_generator_counts_chunks_answers_and_first_tokens():
    app = build_app(StandinConfig(ttft_ms=5, itl_ms=1, tokens=4))
    with serve_in_thread(app) as url:
        result = await run_load(url, model="standin", concurrency=3, duration=0.6, warmup=0.2, cpu_pids={})
        stats = httpx.get(f"{url}/_standin/stats").json()
    assert result["errors"] == 0
    assert result["requests"] > 0
    assert result["ttft_ms"]["n"] == result["requests"]
    assert result["ttft_ms"]["p50"] >= 5  # the stand-in never sends a token before its TTFT
    # chunks in the window belong to answers completed in it, give or take the ones in flight at its edges
    assert abs(result["chunks"] - result["requests"] * CHUNKS_PER_ANSWER) <= 2 * 3 * CHUNKS_PER_ANSWER
    assert stats["finished"] >= result["requests"]


async def test_staggered_streams_start_one_after_another_and_sent_requests_are_counted():
    app = build_app(StandinConfig(ttft_ms=1, itl_ms=10, tokens=100))  # answers of about 1 s
    with serve_in_thread(app) as url:
        spread = await run_load(
            url, model="standin", concurrency=4, duration=0.2, warmup=0.1, cpu_pids={}, stagger=40.0
        )  # streams due at 0, 10, 20 and 30 s: the run is over before the second
        started_spread = httpx.get(f"{url}/_standin/stats").json()["started"]
        together = await run_load(
            url, model="standin", concurrency=4, duration=0.8, warmup=0.1, cpu_pids={}, body_extra={"max_tokens": 5}
        )
        started_together = httpx.get(f"{url}/_standin/stats").json()["started"] - started_spread
    assert started_spread == 1 and spread["requests_started"] == 0  # its one request went out in the warm-up
    assert started_together >= 4
    assert together["requests_started"] >= together["requests"] > 0


async def test_load_generator_reports_broken_streams_and_error_statuses():
    app = build_app(StandinConfig(ttft_ms=1, itl_ms=1, tokens=4))
    with serve_in_thread(app) as url:
        httpx.post(f"{url}/_standin/faults", json={"die_after_chunks": 2})
        broken = await run_load(url, model="standin", concurrency=2, duration=0.4, warmup=0.1, cpu_pids={})
        httpx.post(f"{url}/_standin/faults", json={"status": 503})
        refused = await run_load(url, model="standin", concurrency=2, duration=0.4, warmup=0.1, cpu_pids={})
    assert broken["requests"] == 0 and broken["errors"] > 0
    assert set(broken["error_kinds"]) == {"connection closed mid-response"}
    assert refused["requests"] == 0 and set(refused["error_kinds"]) == {"status 503"}


def test_the_split_of_cpu_seconds_adds_up_to_them():
    user, system = tree_cpu_split(os.getpid())
    assert user > 0 and system >= 0
    assert tree_cpu_seconds(os.getpid()) >= user + system  # (read later: never less)


def test_tree_cpu_seconds_includes_this_process():
    assert os.getpid() in tree_pids(os.getpid())
    before = tree_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert tree_cpu_seconds(os.getpid()) > before


def _result(ttft_p50, chunks_per_s, cpu_proxy=None, chunks=1000, errors=0):
    cpu = {"engine": 1.0} | ({} if cpu_proxy is None else {"proxy": cpu_proxy})
    return {
        "ttft_ms": {"p50": ttft_p50},
        "chunks_per_s": chunks_per_s,
        "cpu_s": cpu,
        "chunks": chunks,
        "errors": errors,
    }


def test_figures_and_goals_from_results():
    results = {
        "direct": {c: _result(20.0, 100.0) for c in (4, 64, 128, 512)},
        "vllm-router": {c: _result(20.5, 100.0, cpu_proxy=0.05) for c in (4, 64, 128, 512)},
        "gateway": {
            4: _result(21.0, 100.0, 0.1),
            64: _result(30.0, 90.0, cpu_proxy=0.2),
            128: _result(30.0, 96.0, 0.2),
            512: _result(30.0, 50.0, 0.2, errors=3),
        },
    }
    ours, router = figures(results, "gateway"), figures(results, "vllm-router")
    assert ours["added_ttft_ms_at_4"] == 1.0 and router["added_ttft_ms_at_4"] == 0.5
    assert ours["cpu_us_per_chunk_at_64"] == 200.0 and router["cpu_us_per_chunk_at_64"] == 50.0
    assert ours["throughput_kept_at_128"] == 0.96
    assert ours["errors_at_512"] == 3
    assert judge(ours, router) == {
        "added_ttft": False, "cpu_per_chunk": False, "throughput": True, "no_errors_at_512": False,
    }  # fmt: skip
    assert judge(ours, None)["added_ttft"] is None


def test_summarize_pools_windows_and_their_samples():
    def window(ttfts, chunks, seconds):
        return {
            "url": "u", "concurrency": 4, "window_s": seconds, "requests": len(ttfts), "chunks": chunks,
            "error_kinds": {"status 503": 1}, "cpu_s": {"proxy": 0.5}, "ttft_samples_ms": ttfts,
        }  # fmt: skip

    pooled = summarize([window([1.0, 2.0], 10, 1.0), window([3.0, 4.0, 5.0], 30, 3.0)])
    assert pooled["ttft_ms"]["p50"] == 3.0 and pooled["ttft_ms"]["n"] == 5
    assert pooled["chunks_per_s"] == 10.0 and pooled["requests"] == 5
    assert pooled["errors"] == 2 and pooled["cpu_s"] == {"proxy": 1.0}
