"""bench.trim_cache: the per-turn table and the trimmed-turn totals of a paired load test."""

from __future__ import annotations

import gzip
import json

from bench.trim_cache import load, markdown, summarise


def _record(target: str, turn: int, status: str, prompt: int, cached: int, ttft: float, **extra) -> dict:
    return {
        "target": target,
        "turn": turn,
        "phase": "measure",
        "error_kind": None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_s": ttft,
        "headers": {"x-trim-status": status},
        **extra,
    }


def test_totals_count_only_the_trimmed_turns(tmp_path):
    records = [
        _record("auto", 0, "kept", 100, 0, 0.5),
        _record("auto", 1, "trimmed", 200, 180, 0.1),
        _record("auto", 2, "trimmed", 220, 200, 0.3),
        _record("window", 0, "kept", 100, 0, 0.5),
        _record("window", 1, "trimmed", 250, 100, 0.4),
        _record("window", 1, "trimmed", 250, 100, 0.9, phase="warmup"),
        _record("window", 2, "trimmed", 250, 100, 0.6, error_kind="http"),
    ]
    (tmp_path / "requests.jsonl.gz").write_bytes(gzip.compress("\n".join(map(json.dumps, records)).encode()))
    summary = summarise(load(tmp_path), by_session=False)
    auto, window = summary["auto"], summary["window"]
    assert auto["first_trimmed_turn"] == 2 and auto["trimmed_requests"] == 2
    assert auto["trimmed_cached_share"] == 380 / 420
    assert auto["trimmed_median_ttft_ms"] == 200.0
    assert auto["prefilled_tokens"] == 100 + 20 + 20
    assert window["requests"] == 2 and window["trimmed_cached_share"] == 100 / 250
    assert [t["turn"] for t in window["turns"]] == [1, 2]
    table = markdown(summary)
    assert (
        "**0.905**" in table
        and "**0.400**" in table
        and "| all | 3 | trimmed | 220 | 200 | 300 | - | - | - | - |" in table
    )


def test_one_row_per_session_and_turn(tmp_path):
    records = [_record("auto", t, "trimmed", 100 + t, 90, 0.1, session_id=s) for s in ("b", "a") for t in (0, 1)]
    (tmp_path / "requests.jsonl").write_text("\n".join(map(json.dumps, records)))
    table = markdown(summarise(load(tmp_path)))
    assert "| 1 | 2 | trimmed | 101 | 90 | 100 |" in table and "| 2 | 1 | trimmed | 100 | 90 | 100 |" in table
