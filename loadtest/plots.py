"""PNG plots of a finished load test (matplotlib, Agg backend: no display needed).

- `ttft.png`, `itl.png`: the distribution of each run's TTFT / ITL (histogram and CDF);
- `latency_over_time.png`: TTFT and E2E latency of every request against its send time,
  failures marked, so a run that degrades over time (or a warm-up) is visible, and the engines'
  KV-cache usage (0..1) when `--metrics-url` was sampled;
- `turns.png` (multi-turn runs): per turn, median TTFT, prompt and cached prompt tokens (the
  server's `usage`), failed requests and KV-cache usage (a ratio, 0..1).

A panel without data (no engine metrics sampled, no failed request) is left out, and
`left_out()` says which and why, for the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.metrics import itl_s, per_turn
from loadtest.runner import RunResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(result: RunResult) -> str:
    return f"{result.target}: {result.run}"


def _distribution(plt, runs: Sequence[tuple[str, list[float]]], title: str, path: Path) -> None:
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in runs:
        if not values:
            continue
        ms = sorted(v * 1000 for v in values)
        hist.hist(ms, bins=40, alpha=0.5, label=name)
        cdf.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=name)
    hist.set_xlabel("ms")
    hist.set_ylabel("count")
    hist.set_title(f"{title}: histogram")
    cdf.set_xlabel("ms")
    cdf.set_ylabel("fraction of values <= x")
    cdf.set_title(f"{title}: CDF")
    for axis in (hist, cdf):
        axis.grid(alpha=0.3)
        if any(values for _, values in runs):
            axis.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(results: Sequence[RunResult], directory: Path) -> list[str]:
    """Write the PNG files into `directory`; returns their file names."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    ttft = [(_name(r), [x.ttft_s for x in r.measured if x.ok and x.ttft_s is not None]) for r in results]
    _distribution(plt, ttft, "TTFT", directory / "ttft.png")
    written.append("ttft.png")
    itl = [(_name(r), [g for x in r.measured if x.ok for g in itl_s(x)]) for r in results]
    _distribution(plt, itl, "ITL (gaps between token chunks)", directory / "itl.png")
    written.append("itl.png")

    sampled = [r for r in results if kv_samples(r)]
    fig, axes = plt.subplots(3 if sampled else 2, 1, figsize=(11, 8 if sampled else 6), sharex=True)
    for result in sampled:
        samples = kv_samples(result)
        axes[2].plot([t for t, _ in samples], [v for _, v in samples], "-", label=_name(result))
    if sampled:
        axes[2].set_ylabel("KV-cache usage (0..1)")
        axes[2].set_ylim(0, 1)
    for result in results:
        ok = [x for x in result.measured if x.ok]
        failed = [x for x in result.measured if not x.ok]
        line = axes[0].plot([x.sent_s for x in ok], [x.ttft_s * 1000 for x in ok], ".", label=_name(result))[0]
        axes[1].plot(
            [x.sent_s for x in ok], [x.e2e_s * 1000 for x in ok], ".", color=line.get_color(), label=_name(result)
        )
        if failed:
            axes[1].plot(
                [x.sent_s for x in failed],
                [0] * len(failed),
                "x",
                color=line.get_color(),
                label=f"{_name(result)} failed",
            )
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("E2E latency (ms)")
    axes[-1].set_xlabel("time since the start of the run (s)")
    axes[0].set_title("Latency over time")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(directory / "latency_over_time.png", dpi=100)
    plt.close(fig)
    written.append("latency_over_time.png")

    if multi_turn(results):
        per_run = [(result, per_turn(result.measured)) for result in results]
        errors = any(row["errors"] for _, rows in per_run for row in rows)
        kv = any(_known(row["max_kv_cache_usage"]) for _, rows in per_run for row in rows)
        panels = 2 + errors + kv
        fig, axes = plt.subplots(panels, 1, figsize=(11, 2.5 * panels), sharex=True)
        error_axis = axes[2] if errors else None
        kv_axis = axes[-1] if kv else None
        for result, rows in per_run:
            turns = [row["turn"] + 1 for row in rows]
            line = axes[0].plot(turns, [row["median_ttft_ms"] for row in rows], "o-", label=_name(result))[0]
            axes[1].plot(
                turns,
                [row["prompt_tokens"] for row in rows],
                "o-",
                color=line.get_color(),
                label=f"{_name(result)}: prompt",
            )
            if any(row["cached_tokens_reported"] for row in rows):
                axes[1].plot(
                    turns,
                    [row["total_cached_tokens"] for row in rows],
                    "s--",
                    color=line.get_color(),
                    label=f"{_name(result)}: cached",
                )
            if error_axis is not None:
                error_axis.plot(turns, [row["errors"] for row in rows], "o-", label=_name(result))
            if kv_axis is not None:
                kv_axis.plot(turns, [row["max_kv_cache_usage"] for row in rows], "o-", label=_name(result))
        axes[0].set_ylabel("median TTFT (ms)")
        axes[1].set_ylabel("prompt tokens (sum)")
        if error_axis is not None:
            error_axis.set_ylabel("failed requests")
            error_axis.set_ylim(bottom=0)
        if kv_axis is not None:
            kv_axis.set_ylabel("max KV-cache usage (0..1)")
            kv_axis.set_ylim(0, 1)
        axes[-1].set_xlabel("turn")
        axes[0].set_title("Per turn of the conversations")
        for axis in axes:
            axis.grid(alpha=0.3)
            axis.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(directory / "turns.png", dpi=100)
        plt.close(fig)
        written.append("turns.png")
    return written


def _known(value: float) -> bool:
    return value == value  # not NaN


def multi_turn(results: Sequence[RunResult]) -> bool:
    return any(x.turn > 0 for r in results for x in r.records)


def kv_samples(result: RunResult) -> list[tuple[float, float]]:
    """(run time, KV-cache usage 0..1) of every engine sample that carried the usage."""
    return [(s[0], s[1]) for s in result.engine.get("samples", []) if s[1] is not None]


def left_out(results: Sequence[RunResult]) -> list[str]:
    """The panels this run's plots leave out for want of data, each with the reason (for report.md)."""
    out = []
    if not any(kv_samples(r) for r in results):
        out.append(
            "KV-cache usage: no engine metrics were sampled (give `--metrics-url`, the gateway's "
            "`http://HOST:PORT/metrics` or an engine's)"
        )
    if multi_turn(results):
        rows = [row for r in results for row in per_turn(r.measured)]
        if not any(row["errors"] for row in rows):
            out.append("failed requests per turn: none failed")
        if any(kv_samples(r) for r in results) and not any(_known(row["max_kv_cache_usage"]) for row in rows):
            out.append("KV-cache usage per turn: no sample fell inside a request (try a shorter `--metrics-interval`)")
    return out
