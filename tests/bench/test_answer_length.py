"""bench/answer_length.py: the split of a proxy's CPU into per-chunk and per-request parts, on made-up windows."""

from __future__ import annotations

import pytest

from bench.answer_length import chunks_per_core_second, fit, per_length, render_markdown


def window(tokens: int, requests: int, a_us: float, b_us: float, noise: float = 0.0) -> dict:
    chunks = requests * (tokens + 2)
    cpu = (chunks * a_us + requests * b_us) * 1e-6 * (1 + noise)
    return {"max_tokens": tokens, "chunks": chunks, "requests_started": requests, "requests": requests - 3,
            "errors": 0, "cpu_s": {"proxy": cpu, "engine": 1.0}, "system_cpu_s": {"proxy": cpu / 2}}  # fmt: skip


def test_the_fit_recovers_the_costs_per_chunk_and_per_request():
    windows = [window(8, 5000, 40.0, 500.0), window(32, 1600, 40.0, 500.0), window(320, 160, 40.0, 500.0)]
    got = fit(windows)
    assert got["a_us_per_chunk"] == pytest.approx(40.0) and got["b_us_per_request"] == pytest.approx(500.0)
    assert got["relative_rms"] == pytest.approx(0.0, abs=1e-9) and got["windows"] == 3


def test_noise_shows_in_the_fits_error_and_one_length_cannot_be_split():
    noisy = fit(
        [window(8, 5000, 40.0, 500.0, 0.05), window(32, 1600, 40.0, 500.0, -0.05), window(320, 160, 40.0, 500.0)]
    )
    assert noisy["relative_rms"] > 0.01
    assert fit([window(32, 1600, 40.0, 500.0)])["a_us_per_chunk"] is None  # one length: chunks and requests collinear
    assert fit([window(32, 1600, 40.0, 500.0), window(32, 800, 40.0, 500.0)])["b_us_per_request"] is None


def test_per_length_pools_rounds_and_counts_the_requests_sent():
    got = per_length([window(32, 1000, 40.0, 340.0), window(32, 1000, 50.0, 340.0), window(8, 10, 40.0, 0.0)])
    assert got[32]["chunks_per_request"] == 34.0  # requests sent in the window, not those also answered in it
    assert got[32]["cpu_us_per_chunk"] == pytest.approx(55.0)
    assert got[32]["rounds_cpu_us_per_chunk"] == pytest.approx([50.0, 60.0])
    assert got[32]["system_us_per_chunk"] == pytest.approx(55.0 / 2)
    assert list(got) == [8, 32]


def test_chunks_per_core_second_at_an_answer_length():
    assert chunks_per_core_second(40.0, 340.0, 34) == pytest.approx(1e6 / 50.0)
    assert chunks_per_core_second(None, 340.0, 34) is None


def test_the_report_gives_both_ratios_and_every_length():
    windows = {
        "vllm-router": [window(t, 1000, 30.0, 200.0) for t in (8, 32, 320)],
        "gateway x1": [window(t, 1000, 36.0, 400.0) for t in (8, 32, 320)],
    }
    report = {
        "date": "d", "commit": "c", "loadavg_before": "0", "loadavg_after": "0", "windows": windows,
        "machine": {"cpu": "x", "cores": 2, "python": "3.11", "vllm_router": "0.1"},
        "fits": {path: fit(ws) for path, ws in windows.items()},
        "lengths": {path: per_length(ws) for path, ws in windows.items()},
    }  # fmt: skip
    text = render_markdown(report)
    assert "per chunk, gateway / vllm-router: 1.20x; per request: 2.00x" in text
    assert "| 320 | 322.0 | 30.6 us | 37.2 us | 1.22x | 15.3 us / 18.6 us |" in text
    assert "| gateway x1 | 36.0 us | 400 us |" in text
    assert "## Method" in text
