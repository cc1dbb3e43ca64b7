"""The plain-text summary a load test prints in the terminal at the end."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.report import Comparison, RunOutcome, _fmt


def _columns(rows: Sequence[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    )


def console_table(outcomes: Sequence[RunOutcome], comparisons: Sequence[Comparison]) -> str:
    """A short plain-text summary for the terminal."""
    rows = [("run", "ok", "err", "req/s", "tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "E2E p50", "cached")]
    for o in outcomes:
        s = o.summary
        rows.append(
            (
                f"{o.result.target}: {o.result.run}",
                _fmt(s["completed"]),
                _fmt(s["failed"]),
                _fmt(s["request_throughput"], 2),
                _fmt(s["output_throughput"], 1),
                _fmt(s.get("median_ttft_ms")),
                _fmt(s.get("p99_ttft_ms")),
                _fmt(s.get("median_tpot_ms"), 2),
                _fmt(s.get("median_itl_ms"), 2),
                _fmt(s.get("median_e2el_ms")),
                _fmt(s.get("cached_token_ratio"), 3),
            )
        )
    text = _columns(rows)
    multi = [o for o in outcomes if len(o.turns) > 1]
    for o in multi:
        turns = [("turn", "requests", "prompt tok", "cached tok", "cached", "TTFT p50")]
        turns += [
            (
                str(t["turn"] + 1),
                _fmt(t["requests"]),
                _fmt(t["prompt_tokens"]),
                _fmt(t["total_cached_tokens"]) if t["cached_tokens_reported"] else "-",
                _fmt(t["cached_token_ratio"], 3),
                _fmt(t["median_ttft_ms"]),
            )
            for t in o.turns
        ]
        text += f"\nper turn, {o.result.target}: {o.result.run}:\n" + _columns(turns)
    engines = [o for o in outcomes if o.summary.get("engine", {}).get("prefix_cache_queries_total")]
    for o in engines:
        engine = o.summary["engine"]
        text += (
            f"\nengine prefix cache, {o.result.target}: {o.result.run}: "
            f"{_fmt(engine.get('prefix_cache_hits_total'), 0)} of "
            f"{_fmt(engine.get('prefix_cache_queries_total'), 0)} tokens hit "
            f"({_fmt(engine.get('prefix_cache_hit_rate'), 3)})"
        )
    for o in outcomes:
        for warning in o.summary.get("generator_warnings") or ():
            text += f"\nWARNING: {o.result.target}: {o.result.run}: {warning}"
    for comparison in comparisons:
        r = comparison.ratios
        text += (
            f"\nB/A at {comparison.run}: TTFT p50 x{_fmt(r['median_ttft_ms'], 3)}, "
            f"E2E p50 x{_fmt(r['median_e2el_ms'], 3)}, "
            f"throughput x{_fmt(r['request_throughput'], 3)}; per prompt B-A (balanced): TTFT "
            f"{_fmt(comparison.paired['balanced_ttft_diff_ms'], 2)} ms, E2E "
            f"{_fmt(comparison.paired['balanced_e2el_diff_ms'], 2)} ms "
            f"({comparison.paired['pairs']} pairs)"
        )
    return text + "\n(latencies in ms)"
