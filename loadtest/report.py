"""The files a load test leaves behind.

In `--output DIR`: `requests.jsonl` (one `RequestRecord` per line, warm-up included and marked),
`summary.json` (configuration, one summary per run in vLLM's key names, comparisons, SLO
verdicts), `report.md` (tables for people) and the PNG plots of `loadtest.plots`. The terminal's
summary is `loadtest.console`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.loop_lag import Limits, saturation
from loadtest.metrics import ALIASES, differences, paired_differences, per_turn, ratios, summarize
from loadtest.runner import RunResult

CAVEAT = (
    "Figures depend on the machine, the model and the engine settings: a tiny model on a "
    "few CPU cores shows the mechanisms, not the numbers of a GPU deployment."
)


@dataclass
class RunOutcome:
    """One run with its computed summary and SLO verdict."""

    result: RunResult
    url: str
    summary: dict
    turns: list[dict]
    verdict: dict | None = None

    @classmethod
    def of(cls, result: RunResult, url: str, slos: dict[str, float], *, limits: Limits | None = None) -> RunOutcome:
        summary = summarize(result.measured, slos=slos)
        summary["engine"] = result.engine
        summary.update(result.loop_lag)
        summary.update(result.process)
        shape = result.shape
        summary["target_rate"] = shape.rate
        summary["generator_warnings"] = saturation(
            summary, target_rate=shape.rate if shape.concurrency is None else None, limits=limits or Limits()
        )
        return cls(result, url, summary, per_turn(result.measured))

    def to_json(self) -> dict:
        return {
            "target": self.result.target,
            "run": self.result.run,
            "url": self.url,
            "load": self.result.shape.to_json(),
            "wall_s": self.result.wall_s,
            "warmup_requests": len(self.result.records) - len(self.result.measured),
            "summary": _finite(self.summary),
            "per_turn": _finite(self.turns),
            "slo": self.verdict,
        }


@dataclass
class Comparison:
    """B against A under the same load: ratios B/A and differences B-A."""

    run: str
    a: RunOutcome
    b: RunOutcome
    mode: str = "sequential"
    ratios: dict = field(init=False)
    differences: dict = field(init=False)
    paired: dict = field(init=False)

    def __post_init__(self) -> None:
        self.ratios = ratios(self.a.summary, self.b.summary)
        self.differences = differences(self.a.summary, self.b.summary)
        self.paired = paired_differences(self.a.result.measured, self.b.result.measured)

    def to_json(self) -> dict:
        return {
            "run": self.run,
            "mode": self.mode,
            "ratios_b_over_a": _finite(self.ratios),
            "differences_b_minus_a": _finite(self.differences),
            "per_prompt_differences_b_minus_a": _finite(self.paired),
        }


def _finite(value):
    """JSON has no NaN: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


TABLE_ROWS = (
    ("completed", "completed requests", 0),
    ("failed", "failed requests", 0),
    ("duration", "measured duration (s)", 2),
    ("request_throughput", "request throughput (req/s)", 2),
    ("output_throughput", "output token throughput (tok/s)", 1),
    ("total_token_throughput", "total token throughput (tok/s)", 1),
    ("request_goodput", "request goodput (req/s)", 2),
    ("slo_attainment", "SLO attainment (0..1)", 3),
    ("mean_ttft_ms", "TTFT mean (ms)", 1),
    ("median_ttft_ms", "TTFT median (ms)", 1),
    ("p99_ttft_ms", "TTFT p99 (ms)", 1),
    ("median_tpot_ms", "TPOT median (ms)", 2),
    ("p99_tpot_ms", "TPOT p99 (ms)", 2),
    ("median_itl_ms", "ITL median (ms)", 2),
    ("p99_itl_ms", "ITL p99 (ms)", 2),
    ("median_e2el_ms", "E2E latency median (ms)", 1),
    ("p99_e2el_ms", "E2E latency p99 (ms)", 1),
    ("median_lateness_ms", "schedule lateness median (ms)", 2),
    ("max_lateness_ms", "schedule lateness max (ms)", 2),
    ("max_concurrent_requests", "peak requests in flight", 0),
    ("target_rate", "open loop: target rate (sessions/s)", 2),
    ("achieved_rate", "achieved rate (session starts/s)", 2),
    ("p99_loop_lag_ms", "load generator event-loop lag p99 (ms)", 2),
    ("max_loop_lag_ms", "load generator event-loop lag max (ms)", 2),
    ("generator_run_queue_wait_share", "load generator waiting for a CPU (share of the run)", 3),
    ("gc_pause_max_ms", "load generator's longest GC pause (ms)", 2),
    ("cached_token_ratio", "cached share of prompt tokens (usage, 0..1)", 3),
    ("median_added_ttft_ms", "load tester's own added TTFT median (ms, vs engine timings)", 2),
    ("p99_added_ttft_ms", "load tester's own added TTFT p99 (ms, vs engine timings)", 2),
    ("total_cached_tokens", "cached prompt tokens (usage)", 0),
    ("total_input_tokens", "prompt tokens (usage)", 0),
    ("total_output_tokens", "completion tokens (usage)", 0),
)


def markdown(
    outcomes: Sequence[RunOutcome],
    comparisons: Sequence[Comparison],
    config: dict,
    plots: Sequence[str],
    *,
    left_out: Sequence[str] = (),
) -> str:
    """The human report: what ran, the headline table, comparisons, errors, turns, plots (and the
    panels the plots left out for want of data, `left_out`, each with its reason)."""
    lines = ["# Load test report", ""]
    lines += [
        f"- command: `{config.get('command', '')}`",
        f"- scenario: `{config.get('scenario')}`, model `{config.get('model')}`, "
        f"seed {config.get('seed')}, max_tokens {config.get('max_tokens')}",
        f"- started: {config.get('started')}",
    ]
    targets = {o.result.target: o.url for o in outcomes}
    for target, url in targets.items():
        lines.append(f"- target {target}: {url}")
    lines += ["", f"> {CAVEAT}", ""]
    warned = [o for o in outcomes if o.summary.get("generator_warnings")]
    if warned:
        lines += ["## Warning: the load generator was the bottleneck", ""]
        for outcome in warned:
            for warning in outcome.summary["generator_warnings"]:
                lines.append(f"- {outcome.result.target}: {outcome.result.run}: {warning}")
        lines += [
            "",
            "Its figures for these runs include its own delays; see docs/benchmarks/load-tester.md "
            '("Its own overhead, measured") for the rates and concurrencies it times exactly.',
            "",
        ]

    lines += ["## Results", ""]
    header = [f"{o.result.target}: {o.result.run}" for o in outcomes]
    lines.append("| metric | " + " | ".join(header) + " |")
    lines.append("|---|" + "---:|" * len(header))
    for key, label, digits in TABLE_ROWS:
        if not any(key in o.summary for o in outcomes):
            continue
        cells = [_fmt(o.summary.get(key), digits) for o in outcomes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    engines = [o for o in outcomes if o.summary.get("engine")]
    if engines:
        for key in (
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "prefix_cache_hit_rate",
            "num_preemptions_total",
        ):
            cells = [_fmt(o.summary.get("engine", {}).get(key), 3) for o in outcomes]
            lines.append(f"| engine {key} (from /metrics) | " + " | ".join(cells) + " |")
    lines.append("")

    if comparisons:
        lines += ["## A/B comparison", "", "Ratios are B / A; differences are B - A.", ""]
        lines.append("| run | metric | A | B | B / A | B - A |")
        lines.append("|---|---|---:|---:|---:|---:|")
        for comparison in comparisons:
            for key, ratio in comparison.ratios.items():
                lines.append(
                    f"| {comparison.run} | {key} | {_fmt(comparison.a.summary.get(key), 2)} | "
                    f"{_fmt(comparison.b.summary.get(key), 2)} | {_fmt(ratio, 3)} | "
                    f"{_fmt(comparison.differences.get(key), 2)} |"
                )
        lines += [
            "",
            "Per prompt (B - A over the prompts both answered, matched by session "
            "and turn; in `paired` mode each pair was sent back to back):",
            "",
            "| run | mode | pairs | TTFT balanced | TTFT median | TTFT mean | TTFT p90 | "
            "E2E balanced | E2E median | E2E mean | E2E p90 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for comparison in comparisons:
            p = comparison.paired
            lines.append(
                f"| {comparison.run} | {comparison.mode} | {p['pairs']} | "
                + " | ".join(
                    f"{_fmt(p[f'{stat}_{name}_diff_ms'], 2)} ms"
                    for name in ("ttft", "e2el")
                    for stat in ("balanced", "median", "mean", "p90")
                )
                + " |"
            )
        lines += [
            "",
            "`balanced` = mean of the median difference over pairs where A went "
            "first and over pairs where B went first (cancels the prefix-cache advantage "
            "of going second when A and B share an engine).",
        ]
        lines.append("")

    verdicts = [o for o in outcomes if o.verdict is not None]
    if verdicts:
        lines += ["## SLOs", ""]
        slos = verdicts[0].summary.get("slos_ms", {})
        lines.append(
            "Limits per request: "
            + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
            + f"; required attainment {verdicts[0].verdict['required']:g}."
        )
        lines.append("")
        for outcome in verdicts:
            v = outcome.verdict
            state = "PASS" if v["passed"] else "MISS"
            lines.append(
                f"- {outcome.result.target}: {outcome.result.run}: {state} (attainment {_fmt(v['slo_attainment'], 3)})"
            )
        lines.append("")

    failing = [o for o in outcomes if o.summary.get("failed")]
    if failing:
        lines += ["## Errors", ""]
        for outcome in failing:
            counts = {k: v for k, v in outcome.summary["errors"].items() if v}
            lines.append(f"- {outcome.result.target}: {outcome.result.run}: {counts}")
            for example in outcome.summary.get("error_examples", []):
                lines.append(f"  - {example['kind']} (turn {example['turn']}): `{(example['error'] or '')[:200]}`")
        lines.append("")

    multi = [o for o in outcomes if len(o.turns) > 1]
    if multi:
        kv_known = any(row["max_kv_cache_usage"] == row["max_kv_cache_usage"] for o in multi for row in o.turns)
        lines += ["## Per turn", ""]
        lines.append(
            "| run | turn | requests | errors | trimmed | median TTFT (ms) | median "
            "prompt tokens | prompt tokens | cached tokens | cached share | median "
            "prompt chars |" + (" max KV-cache usage (0..1) |" if kv_known else "")
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if kv_known else ""))
        for outcome in multi:
            for row in outcome.turns:
                kv = row["max_kv_cache_usage"]
                lines.append(
                    f"| {outcome.result.target}: {outcome.result.run} | {row['turn'] + 1} | "
                    f"{row['requests']} | {row['errors']} | {row['trimmed']} | "
                    f"{_fmt(row['median_ttft_ms'])} | "
                    f"{_fmt(row['median_prompt_tokens'], 0)} | "
                    f"{row['prompt_tokens']} | "
                    f"{row['total_cached_tokens'] if row['cached_tokens_reported'] else '-'} | "
                    f"{_fmt(row['cached_token_ratio'], 3)} | "
                    f"{_fmt(row['median_prompt_chars'], 0)} |" + (f" {_fmt(kv, 3)} |" if kv_known else "")
                )
        lines += [
            "",
            "Prompt tokens are the server's `usage` of the requests that succeeded "
            "(after any trimming); cached tokens are `usage.prompt_tokens_details."
            "cached_tokens` (vLLM reports them with `--enable-prompt-tokens-details`; "
            "`-` when the server did not), and cached share = cached / prompt tokens; "
            "prompt chars are what the client sent; `trimmed` "
            "counts responses with `x-trim-status: trimmed` (with `--record-header "
            "x-trim-status`)."
            + (
                " Max KV-cache usage is the highest engine-wide share of KV blocks in use (0..1) sampled "
                "while the turn's requests were in flight (`--metrics-url`)."
                if kv_known
                else " No KV-cache usage was sampled during a request, so that column is left out."
            ),
        ]
        lines.append("")

    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{name}]({name})" for name in plots]
        lines.append("")
        if left_out:
            lines += ["Left out of the plots, for want of data:", ""]
            lines += [f"- {reason}" for reason in left_out]
            lines.append("")

    lines += [
        "## Definitions",
        "",
        "TTFT: send -> first token chunk with text. TPOT: (E2E - TTFT) / (completion "
        "tokens - 1). ITL: gaps between consecutive token chunks, pooled. E2E latency: "
        "send -> last token chunk. Throughputs divide by the measured duration (first "
        "send -> last request over). Lateness: send - scheduled time. Tokens from the "
        "server's `usage`. Other tools' names:",
        "",
    ]
    lines += [f"- `{key}`: {alias}" for key, alias in ALIASES.items()]
    lines.append("")
    return "\n".join(lines)


def write_outputs(
    directory: Path,
    outcomes: Sequence[RunOutcome],
    comparisons: Sequence[Comparison],
    config: dict,
    *,
    plots: bool = True,
) -> dict:
    """Write every output file into `directory`; returns the summary JSON document."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "requests.jsonl").open("w") as out:
        for outcome in outcomes:
            for record in outcome.result.records:
                out.write(json.dumps(_finite(record.to_json())) + "\n")
    document = {
        "config": config,
        "runs": [o.to_json() for o in outcomes],
        "comparisons": [c.to_json() for c in comparisons],
        "passed": all(o.verdict["passed"] for o in outcomes if o.verdict is not None),
        "metric_aliases": ALIASES,
        "caveat": CAVEAT,
    }
    (directory / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    names: list[str] = []
    omitted: list[str] = []
    if plots:
        from loadtest.plots import left_out, write_plots

        results = [o.result for o in outcomes]
        names = write_plots(results, directory)
        omitted = left_out(results)
    (directory / "report.md").write_text(markdown(outcomes, comparisons, config, names, left_out=omitted))
    return document
