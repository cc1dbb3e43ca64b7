"""The raw data of every recorded run, and which runs each headline counts (with the reason)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import trim_cache

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
GATEWAY_RUNS = RESULTS / "data" / "gateway-runs.json"
CAPPED_015 = DOCS / "bench" / "workers-capped-0.15" / "workers.json"  # the one run at 0.15 of a core
ROUTING = ROOT / "loadtest" / "results" / "cache-aware-routing"
OVERHEAD = ROOT / "loadtest" / "results" / "client-overhead" / "overhead.json"
TRIMMING = ROOT / "loadtest" / "results" / "watermark-trimming" / "itinerary"

# The runs each headline counts, and why the others are left out.
SIDE_BY_SIDE_RUNS = ("17", "18", "19")  # the gateway code of 23edca3 (no server/ change up to 56c0ff0)
WAIT_RULE_RUNS = ("l", "m", "n")  # issue 34's wait rule, first version (426dae3), `--before 988b4f5`
FINAL_RUNS = ("o", "p", "q")  # issue 34's final code (a5a236a), three runs, `--before 988b4f5`
ROUTING_RUNS = ("d", "e", "f")  # the routing code after the approximate index learned characters per token
# Committed with the results (the runs did not record the code they ran; later runs do: meta.gateway_code).
ROUTING_COMMITS = {"a": "d0e5f46", "b": "d0e5f46", "c": "2420e90", "d": "9da2e35", "e": "99ba8d2", "f": "65e0f56"}
OVERHEAD_COMMITS = {"run 1": "a22c06e", "run 2": "0f6b0a6", "run 3": "f40eb69"}
TRIMMING_COMMIT = "03537ff"


def gateway_runs() -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = json.loads(GATEWAY_RUNS.read_text())["runs"]
    return runs


def routing_runs() -> dict[str, dict[str, Any]]:
    """Run letter -> summary.json of every routing experiment under loadtest/results/cache-aware-routing/."""
    runs = {}
    for path in sorted(ROUTING.glob("*/summary.json")):
        letter = path.parent.name.split("-", 1)[0]
        runs[letter] = {"folder": path.parent.name, **json.loads(path.read_text())}
    return runs


def share_vs_oracle(run: dict[str, Any], label: str) -> list[float]:
    """The label's cached share over the oracle's, per round (from the run's own verdicts)."""
    goals = run["goals"]
    return [goals[key]["share_vs_oracle"] for key in sorted(goals) if key.startswith(f"{label} (round")]


def share_of_oracle(run: dict[str, Any], label: str) -> list[float]:
    """Any policy's cached share over the oracle's in the same round, from the phases' own shares."""
    by = {(r["label"], r["round"]): r["cached_share"] for r in run["results"]}
    return [by[(label, n)] / by[("oracle", n)] for (name, n) in sorted(by) if name == label and ("oracle", n) in by]


def p90_vs(run: dict[str, Any], label: str, base: str) -> list[float]:
    by = {(r["label"], r["round"]): r for r in run["results"]}
    rounds = sorted({r for (_, r) in by})
    return [
        by[(label, r)]["ttft_p90_s"] / by[(base, r)]["ttft_p90_s"]
        for r in rounds
        if (label, r) in by and (base, r) in by
    ]


def overhead_rows(run: str, mode: str, gc: str = "frozen") -> dict[str, dict[str, float]]:
    """Load label -> added TTFT p50/p99 (ms) of one selfcheck run (`run 1`..`run 3`), mode `shared` or `core`."""
    labels = json.loads(OVERHEAD.read_text())["labels"]
    key = next(k for k in labels if k.startswith(run + " ") and (("a core each" in k) == (mode == "core")))
    return {
        row["load"]["label"]: {"p50": row["median_added_ttft_ms"], "p99": row["p99_added_ttft_ms"]}
        for row in labels[key]["rows"]
        if row["gc"] == gc
    }


def trimming() -> dict[str, Any]:
    return trim_cache.summarise(trim_cache.load(TRIMMING))


LOADS = (
    "concurrency 1",
    "concurrency 8",
    "concurrency 32",
    "concurrency 128",
    "concurrency 256",
    "concurrency 512",
    "rate 50/s (constant)",
    "rate 100/s (constant)",
    "rate 200/s (constant)",
    "rate 300/s (constant)",
    "rate 400/s (constant)",
    "rate 600/s (constant)",
)


def held_everywhere(mode: str, limit_ms: float = 10.0) -> list[str]:
    """Loads at which the added TTFT p99 stayed under the limit in every run."""
    per_run = [overhead_rows(run, mode) for run in OVERHEAD_COMMITS]
    return [load for load in LOADS if all(rows[load]["p99"] < limit_ms for rows in per_run)]
