"""bench/fairness.py's `where` page: each path's worst turn beside the batch against its own alone,
and the slow turns counted per path (made-up runs, no engine)."""

from __future__ import annotations

from bench.fairness import where_lines


def phase(ttfts: list[float | None], makespan: float | None = None) -> dict:
    worst = max((t if t is not None else float("inf") for t in ttfts), default=None)
    figures = {"turn_ttft_s": ttfts, "worst_turn_s": worst, "makespan_s": makespan, "failed": 0}
    return {"figures": figures, "requests": []}


def run(gateway_beside: list[float | None], engine_beside: list[float | None]) -> dict:
    out = {
        "alone_gateway": phase([0.05, 0.1]),
        "alone_engine": phase([0.04, 0.08]),
        "beside_gateway": phase(gateway_beside, 40.0),
        "beside_engine": phase(engine_beside, 42.0),
    }
    out["goals"] = {
        p: out[f"beside_{p}"]["figures"]["worst_turn_s"] / out[f"alone_{p}"]["figures"]["worst_turn_s"]
        for p in ("gateway", "engine")
    }
    return out


def test_each_path_is_set_against_its_own_alone_and_slow_turns_are_counted():
    page = "\n".join(where_lines([run([0.06, 0.5, 0.3], [0.8, 0.07, 0.09])]))
    assert "| worst turn beside the batch / alone | 5.00 (5.00..5.00, 1 runs) | 10.00 (10.00..10.00, 1 runs) |" in page
    assert "| turns beside the batch slower than 0.25 s | 2 (2..2, 1 runs) | 1 (1..1, 1 runs) |" in page
    assert "- run 0 beside_engine: 0.80, 0.07, 0.09" in page


def test_a_turn_without_a_first_token_counts_as_slow():
    page = "\n".join(where_lines([run([0.06, None], [0.07, 0.09])]))
    assert "| turns beside the batch slower than 0.25 s | 1 (1..1, 1 runs) | 0 (0..0, 1 runs) |" in page
    assert "- run 0 beside_gateway: 0.06, -" in page
