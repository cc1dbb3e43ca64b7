"""bench/workers_bench.py's arithmetic and report, on made-up windows (no process started)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from bench.procs import Processes, start_standin, wait_chat_ready
from bench.proxy_bench import MODEL
from bench.workers_bench import (
    CPU_CGROUPS,
    CpuCaps,
    figures,
    ratios,
    render_markdown,
    run_side_by_side,
    side_by_side_figures,
    side_by_side_ttft,
)


def window(concurrency: int, chunks: int, proxy_cpu: float | None, ttft_p50: float = 21.0, errors: int = 0) -> dict:
    cpu = {"engine": 1.0, "loadgen": 0.5, **({"proxy": proxy_cpu} if proxy_cpu is not None else {})}
    return {
        "concurrency": concurrency, "chunks": chunks, "chunks_per_s": chunks / 8.0, "window_s": 8.0,
        "errors": errors, "error_kinds": {"status 503": errors} if errors else {},
        "ttft_ms": {"p50": ttft_p50, "p90": None, "p99": None}, "cpu_s": cpu,
        "foreign_cpu_s": 0.4,
    }  # fmt: skip


RESULTS = {
    "direct": {4: window(4, 1000, None, ttft_p50=20.0)},
    "vllm-router": {4: window(4, 1000, 0.1, ttft_p50=20.5), 64: window(64, 50_000, 1.5)},
    "gateway x1": {
        4: window(4, 1000, 0.2, ttft_p50=20.7), 64: window(64, 50_000, 2.0),
        256: window(256, 100_000, 8.0), 512: window(512, 90_000, 8.0, errors=3),
    },
    "gateway x2": {
        4: window(4, 1000, 0.3, ttft_p50=21.0), 64: window(64, 50_000, 2.5),
        256: window(256, 150_000, 12.0), 512: window(512, 180_000, 15.0),
    },
    "gateway x2 core 1": {4: window(4, 1000, 0.3, ttft_p50=20.9)},
    "gateway x1 capped": {64: window(64, 50_000, 2.0), 256: window(256, 20_000, 2.0)},
    "gateway x2 capped": {64: window(64, 50_000, 2.0), 256: window(256, 38_000, 4.0)},
}  # fmt: skip


def test_figures_take_the_highest_rate_as_the_ceiling_and_chunks_per_proxy_cpu_second():
    one = figures(RESULTS, "gateway x1")
    assert one["added_ttft_ms_at_4"] == pytest.approx(0.7)
    assert one["cpu_us_per_chunk_at_64"] == pytest.approx(40.0)
    assert one["ceiling_chunks_per_s"] == 100_000 / 8 and one["ceiling_at_streams"] == 256
    assert one["chunks_per_proxy_core_s"] == pytest.approx(100_000 / 8.0)
    assert one["ceiling_cores_used"]["proxy"] == pytest.approx(1.0)
    assert figures(RESULTS, "direct")["added_ttft_ms_at_4"] is None


def test_ratios_compare_the_gateway_with_the_router_and_two_workers_with_one():
    r = ratios({path: figures(RESULTS, path) for path in RESULTS})
    assert r["cpu_per_chunk_x1_vs_router"] == pytest.approx(40.0 / 30.0)
    assert r["ceiling_x2_vs_x1"] == pytest.approx(180_000 / 100_000)
    assert r["added_ttft_x1_minus_router_ms"] == pytest.approx(0.2)
    assert r["added_ttft_x2_minus_router_ms"] == pytest.approx(0.5)
    assert r["added_ttft_x2_core1_minus_router_ms"] == pytest.approx(0.4)
    assert r["per_core_x2_vs_x1"] == pytest.approx((180_000 / 15.0) / (100_000 / 8.0))
    assert r["ceiling_x2_vs_x1_capped"] == pytest.approx(38_000 / 20_000)
    assert ratios({})["ceiling_x2_vs_x1"] is None and ratios({})["ceiling_x2_vs_x1_capped"] is None


def test_cpu_rounds_are_reported_each():
    results = {
        "vllm-router": {64: {**window(64, 150_000, 4.5), "rounds_cpu_us_per_chunk": [29.0, 31.0, 30.0]}},
        "gateway x1": {64: {**window(64, 150_000, 6.0), "rounds_cpu_us_per_chunk": [41.5, 38.5, 40.0]}},
    }
    fig = {path: figures(results, path) for path in results}
    assert fig["gateway x1"]["cpu_us_per_chunk_rounds"] == [41.5, 38.5, 40.0]
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "unavailable": {},
        "machine": {"cpu": "x", "cores": 2, "kernel": "k", "python": "3.11", "vllm_router": "0.1"},
        "results": results, "figures": fig, "ratios": ratios(fig),
    }  # fmt: skip
    text = render_markdown(report)
    assert "each interleaved round: vllm-router 29.0, 31.0, 30.0 us; gateway x1 41.5, 38.5, 40.0 us" in text
    assert "gateway (1 worker) / vllm-router, in interleaved windows: 1.33x" in text
    # Paired round by round: 41.5/29, 38.5/31, 40/30; the median is the middle one.
    assert "round by round 1.43x, 1.24x, 1.33x (median 1.33x)" in text


def side_window(chunks: int, proxy_cpu: float, errors: int = 0) -> dict:
    return window(64, chunks, proxy_cpu, errors=errors)


def test_side_by_side_pairs_the_two_paths_window_by_window():
    windows = [
        {"vllm-router": side_window(100_000, 3.0), "gateway x1": side_window(100_000, 3.6)},
        {"vllm-router": side_window(100_000, 4.0), "gateway x1": side_window(50_000, 2.2, errors=2)},
        {"vllm-router": side_window(100_000, 2.5), "gateway x1": side_window(100_000, 3.25)},
    ]
    side = side_by_side_figures(windows, ["vllm-router", "gateway x1"])
    assert side["cpu_us_per_chunk_rounds"][1] == {"vllm-router": pytest.approx(40.0), "gateway x1": pytest.approx(44.0)}
    assert side["ratio_rounds"] == [pytest.approx(1.2), pytest.approx(1.1), pytest.approx(1.3)]
    assert side["ratio_median"] == pytest.approx(1.2)
    assert side["errors"] == 2 and side["concurrency"] == 64
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "unavailable": {},
        "machine": {"cpu": "x", "cores": 2, "kernel": "k", "python": "3.11", "vllm_router": "0.1"},
        "results": {}, "figures": {}, "ratios": ratios({}), "side_by_side": side,
    }  # fmt: skip
    text = render_markdown(report)
    assert (
        "side by side (vllm-router and gateway x1 relaying at once, 64 streams each), gateway x1 / vllm-router: "
        "median 1.20x (goal <= 1.25x); round by round 1.20x, 1.10x, 1.30x" in text
    )
    assert "vllm-router 40.0, gateway x1 44.0" in text and "errors 2" in text


def ttft_window(p50: float, samples: list[float], errors: int = 0) -> dict:
    return {"concurrency": 4, "errors": errors, "ttft_ms": {"p50": p50}, "ttft_samples_ms": samples}


def test_added_ttft_side_by_side_is_taken_over_direct_in_the_same_windows():
    windows = [
        {"direct": ttft_window(20.0, [19.9, 20.0, 20.1]), "vllm-router": ttft_window(20.4, [20.3, 20.4, 20.5]),
         "gateway x1": ttft_window(20.6, [20.5, 20.6, 20.7]), "gateway x2 core 1": ttft_window(20.0, [20.0])},
        {"direct": ttft_window(21.0, [20.9, 21.0, 21.1]), "vllm-router": ttft_window(21.3, [21.2, 21.3, 21.4]),
         "gateway x1": ttft_window(21.8, [21.7, 21.8, 21.9], errors=1), "gateway x2 core 1": ttft_window(21.0, [21.0])},
    ]  # fmt: skip
    side = side_by_side_ttft(windows, ["vllm-router", "gateway x1", "gateway x2 core 1"])
    # Pooled: the medians of all six samples of each path (20.5, 20.85, 21.2), minus direct's.
    assert side["added_ms"] == {
        "vllm-router": pytest.approx(0.35), "gateway x1": pytest.approx(0.7), "gateway x2 core 1": pytest.approx(0.0)
    }  # fmt: skip
    assert side["minus_first_ms"] == {"gateway x1": pytest.approx(0.35), "gateway x2 core 1": pytest.approx(-0.35)}
    assert side["minus_first_rounds_ms"]["gateway x1"] == [pytest.approx(0.2), pytest.approx(0.5)]
    assert side["samples"] == {"direct": 6, "vllm-router": 6, "gateway x1": 6, "gateway x2 core 1": 2}
    assert side["errors"] == 1
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "unavailable": {},
        "machine": {"cpu": "x", "cores": 2, "kernel": "k", "python": "3.11", "vllm_router": "0.1"},
        "results": {}, "figures": {}, "ratios": ratios({}), "side_by_side_ttft": side,
    }  # fmt: skip
    text = render_markdown(report)
    assert "vllm-router 0.35 ms, gateway x1 0.70 ms, gateway x2 core 1 0.00 ms over direct" in text
    assert "gateway x1 minus vllm-router: 0.35 ms (window by window 0.20, 0.50 ms)" in text
    assert "gateway x2 core 1 minus vllm-router: -0.35 ms (window by window -0.40, -0.30 ms)" in text


def test_side_by_side_rounds_turn_which_load_generator_starts_first(monkeypatch, capsys):
    import bench.workers_bench as wb

    calls = []

    def fake(engine, infos, concurrency, duration, warmup, samples):
        calls.append((list(infos), samples))
        return {p: {"n": len(calls)} for p in infos}

    monkeypatch.setattr(wb, "run_side_by_side", fake)
    paths = {"direct": {}, "vllm-router": {}, "gateway x1": {}}
    windows = wb.side_by_side_rounds(None, paths, 4, 4, 1.0, 0.0, show=lambda w: f"#{w['n']}", samples=True)
    assert [order for order, _ in calls] == [
        ["direct", "vllm-router", "gateway x1"], ["vllm-router", "gateway x1", "direct"],
        ["gateway x1", "direct", "vllm-router"], ["direct", "vllm-router", "gateway x1"],
    ]  # fmt: skip
    assert all(samples for _, samples in calls) and [w["direct"]["n"] for w in windows] == [1, 2, 3, 4]
    assert "round 1: direct #2, vllm-router #2, gateway x1 #2" in capsys.readouterr().out


def test_side_by_side_loads_both_paths_in_the_same_seconds():
    with Processes() as procs:
        engine, url = start_standin(procs, core=None)
        assert wait_chat_ready(engine, url, MODEL, timeout=60) is None
        both = {"a": {"url": url, "process": engine}, "b": {"url": url, "process": engine}}
        # Windows of 4 s: long enough to overlap however late a busy machine starts the second one.
        windows = run_side_by_side(engine, both, concurrency=2, duration=4.0, warmup=0.5)
        peak = httpx.get(f"{url}/_standin/stats").json()["peak_running"]
    assert set(windows) == {"a", "b"}
    for name in both:
        assert windows[name]["errors"] == 0 and windows[name]["chunks"] > 0
        assert windows[name]["cpu_s"]["proxy"] > 0  # the engine's CPU here, standing in for a proxy's
    # Each load generator keeps its 2 streams going: more than 2 at once only if both ran together.
    assert peak > 2


def test_side_by_side_ttft_windows_carry_every_sample_and_direct_needs_no_process():
    with Processes() as procs:
        engine, url = start_standin(procs, core=None)
        assert wait_chat_ready(engine, url, MODEL, timeout=60) is None
        paths = {"direct": {"url": url, "process": None}, "a": {"url": url, "process": engine}}
        windows = run_side_by_side(engine, paths, concurrency=2, duration=2.0, warmup=0.5, samples=True)
    assert "proxy" not in windows["direct"]["cpu_s"] and windows["a"]["cpu_s"]["proxy"] > 0
    for name in paths:
        samples = windows[name]["ttft_samples_ms"]
        assert samples and len(samples) == windows[name]["ttft_ms"]["n"]


def test_the_report_names_every_path_and_goal():
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "unavailable": {},
        "machine": {"cpu": "x", "cores": 2, "kernel": "k", "python": "3.11", "vllm_router": "0.1"},
        "results": RESULTS, "cap": 0.3,
    }  # fmt: skip
    report["figures"] = {path: figures(RESULTS, path) for path in RESULTS}
    report["ratios"] = ratios(report["figures"])
    text = render_markdown(report)
    for needle in ("| gateway x2 |", "| vllm-router |", "goal <= 1.25x", "2 workers / 1 worker: 1.80x", "## Method",
                   "gateway x1 at 512 streams: 3 (status 503 x3)", "2 workers on the router's core 0.40 ms",
                   "held to 0.3 of a core (CFS quota; engine and load generator alone on core 0), 2 workers / 1 "
                   "worker: 1.90x"):  # fmt: skip
        assert needle in text


@pytest.mark.skipif(not os.access(CPU_CGROUPS, os.W_OK), reason="no writable cgroup cpu controller here")
def test_a_capped_process_gets_its_quota_and_the_cgroup_goes_with_the_caps():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with CpuCaps() as caps:
            caps.cap(process.pid, 0.25)
            (group,) = caps.groups
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
            assert (group / "cgroup.procs").read_text().split() == [str(process.pid)]
        assert not group.exists()  # the process, still running, was moved back first
    finally:
        process.kill()
        process.wait()


def test_the_no_flow_path_has_the_same_tenants_and_no_flow_gate():
    from prometheus_client import CollectorRegistry

    from bench.workers_bench import TENANTS, TENANTS_NO_FLOW, tenants_config
    from server.gateway.flow.gate import build_gate
    from server.gateway.settings import GatewaySettings

    with_gate, without = (GatewaySettings.model_validate(tenants_config(p)) for p in (TENANTS, TENANTS_NO_FLOW))
    assert [t.name for t in with_gate.tenants] == [t.name for t in without.tenants] == ["planner", "articles"]
    assert with_gate.tenants[0].limits == without.tenants[0].limits
    assert build_gate(with_gate, [], CollectorRegistry()) is not None
    assert build_gate(without, [], CollectorRegistry()) is None
