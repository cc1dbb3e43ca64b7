"""The headline figures: each the median of the runs it counts, with the range and the count,
and the small text helpers every results page uses."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.results.data import (
    OVERHEAD_COMMITS,
    ROUTING_RUNS,
    SIDE_BY_SIDE_RUNS,
    TRIMMING_COMMIT,
    gateway_runs,
    overhead_rows,
    routing_runs,
    share_vs_oracle,
    trimming,
)


@dataclass(frozen=True)
class Headline:
    """One row of the headline table: a figure over the runs it counts."""

    what: str
    values: Sequence[float]
    fmt: Callable[[float], str]
    commit: str
    command: str
    page: str  # relative to docs/
    note: str = ""
    unit: str = "runs"

    def cells(self, prefix: str) -> list[str]:
        values = sorted(self.values)
        unit = self.unit if len(values) > 1 else self.unit.rstrip("s")
        runs = f"{len(values)} {unit}" + (f" ({self.note})" if self.note else "")
        spread = f"{self.fmt(values[0])} - {self.fmt(values[-1])}" if len(values) > 1 else "one run"
        link = f"[{self.what}]({prefix}{self.page})"
        command = self.command if "`" in self.command else f"`{self.command}`"
        return [link, f"**{self.fmt(statistics.median(values))}**", spread, runs, self.commit, command]


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def ms(value: float) -> str:
    return f"{value:+.2f} ms"


def share(value: float) -> str:
    return f"{value:.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def spread_text(values: Sequence[float], fmt: Callable[[float], str], unit: str = "runs") -> str:
    ordered = sorted(values)
    if len(ordered) == 1:
        return f"{fmt(ordered[0])} (one {unit[:-1]})"
    return f"{fmt(statistics.median(ordered))}, {fmt(ordered[0])} - {fmt(ordered[-1])} over {len(ordered)} {unit}"


def headlines() -> list[Headline]:
    runs = {r["id"]: r for r in gateway_runs()}
    side = [runs[i]["figures"]["cpu_ratio_side_by_side"] for i in SIDE_BY_SIDE_RUNS]
    ttft = [
        r["figures"]["added_ttft_side_by_side_x1_minus_router_ms"]
        for r in runs.values()
        if "added_ttft_side_by_side_x1_minus_router_ms" in r["figures"]
    ]
    capped = [
        r["figures"]["capped_ceiling_ratio"]
        for r in runs.values()
        if r["figures"].get("cap") == 0.2 and "capped_ceiling_ratio" in r["figures"]
    ]
    routing = routing_runs()
    precise = [v for letter in ROUTING_RUNS for v in share_vs_oracle(routing[letter], "precise")]
    core = [overhead_rows(run, "core")["concurrency 128"]["p99"] for run in OVERHEAD_COMMITS]
    trim = trimming()
    return [
        Headline(
            "Gateway CPU per streamed chunk / vllm-router's, side by side (64 streams, 1 worker)",
            side,
            ratio,
            "23edca3 - 56c0ff0 (no server/ change between)",
            "make bench",
            "results/gateway-runs.md#cpu-per-chunk-side-by-side",
            "runs 17-19, the relay code of 23edca3",
        ),
        Headline(
            "Added p50 time to first token over vllm-router's, side by side (4 streams)",
            ttft,
            ms,
            "a93726e - 56c0ff0 (the code of 23edca3)",
            "make bench",
            "results/gateway-runs.md#added-time-to-first-token",
            "runs 18-19: the only runs that measure it side by side",
        ),
        Headline(
            "Ceiling of 2 gateway workers / 1, each capped at 0.2 of a core",
            capped,
            ratio,
            "1049346 - 56c0ff0",
            "make bench",
            "results/gateway-runs.md#two-workers-over-one",
            "every run with the capped paths; the code changed between them",
        ),
        Headline(
            "Cache-aware routing (precise index): cached share of prompt tokens / the oracle's",
            precise,
            share,
            "9da2e35 - 65e0f56",
            "make routing-experiment",
            "results/routing.md#cached-share-of-the-oracles",
            "runs d, e, f: 2 rounds each",
            "rounds",
        ),
        Headline(
            "Load tester's own added TTFT p99 at 128 streams, a core of its own",
            core,
            lambda v: f"{v:.1f} ms",
            "a22c06e - f40eb69",
            "loadtest/results/client-overhead/bench.sh",
            "results/load-tester.md#what-the-load-tester-adds",
            "runs 1-3; the commits that added their results",
            "runs",
        ),
        Headline(
            "Watermark trimming: prompt tokens from the prefix cache after the first cut (window: "
            f"{trim['window']['trimmed_cached_share']:.3f})",
            [trim["watermark"]["trimmed_cached_share"]],
            lambda v: f"{v:.3f}",
            TRIMMING_COMMIT,
            "`make run`, then the `python -m loadtest` command in `loadtest/results/watermark-trimming/README.md`",
            "results/index.md#history-trimming",
            "deterministic token counts",
        ),
    ]


def headline_table(prefix: str) -> list[str]:
    header = ["figure", "median", "range", "runs", "commit", "reproduce with"]
    return table(header, [h.cells(prefix) for h in headlines()])
