"""The results pages' plots (matplotlib, Agg), drawn from the same raw data: `python -m bench.results --plots`."""

from __future__ import annotations

import statistics

from bench.results.data import (
    LOADS,
    OVERHEAD_COMMITS,
    RESULTS,
    gateway_runs,
    overhead_rows,
    routing_runs,
    share_vs_oracle,
)


def plots() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = RESULTS / "img"
    img.mkdir(parents=True, exist_ok=True)
    runs = [r for r in gateway_runs() if "cpu_ratio_interleaved" in r["figures"]]
    ids = [r["id"] for r in runs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    inter = [r["figures"]["cpu_ratio_interleaved"] for r in runs]
    side = [r["figures"].get("cpu_ratio_side_by_side") for r in runs]
    top.plot(ids, inter, "o-", label="interleaved windows")
    top.plot([i for i, v in zip(ids, side) if v], [v for v in side if v], "s-", label="side by side")
    top.axhline(1.25, color="grey", linestyle="--", label="goal 1.25x")
    top.set_ylabel("CPU per chunk, gateway / router")
    top.legend(loc="upper right", fontsize=8)
    capped = [r["figures"].get("capped_ceiling_ratio") for r in runs]
    pts = [(i, v) for i, v in zip(ids, capped) if v]
    bottom.bar([i for i, _ in pts], [v for _, v in pts], color="tab:green")
    median = statistics.median(v for _, v in pts)
    bottom.axhline(median, color="black", label=f"median {median:.2f}x over {len(pts)} runs")
    bottom.axhline(1.8, color="grey", linestyle="--", label="goal 1.8x")
    bottom.set_ylabel("2 capped workers / 1")
    bottom.set_xlabel("run (docs/results/gateway-runs.md)")
    bottom.legend(loc="upper left", fontsize=8)
    for label, r in zip(ids, runs):
        if r["dirty"]:
            top.annotate(
                "dirty",
                (label, r["figures"]["cpu_ratio_interleaved"]),
                fontsize=7,
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
            )
    fig.tight_layout()
    fig.savefig(img / "gateway-runs.png", dpi=90, metadata={"Software": None})
    plt.close(fig)

    routing = routing_runs()
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, marker in (("precise", "o"), ("approximate", "s")):
        xs, ys = [], []
        for letter, run in routing.items():
            for n, value in enumerate(share_vs_oracle(run, label)):
                xs.append(f"{letter}{n + 1}")
                ys.append(value)
        ax.plot(xs, ys, marker, label=label)
    ax.axhline(0.98, color="grey", linestyle="--", label="within 2% of the oracle")
    ax.set_ylabel("cached share / the oracle's")
    ax.set_xlabel("run and round (loadtest/results/cache-aware-routing/)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "routing.png", dpi=90, metadata={"Software": None})
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    levels = [load for load in LOADS if load.startswith("concurrency")]
    for run in OVERHEAD_COMMITS:
        rows = overhead_rows(run, "core")
        ax.plot([int(level.split()[1]) for level in levels], [rows[level]["p99"] for level in levels], "o-", label=run)
    ax.axhline(10, color="grey", linestyle="--", label="10 ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("added TTFT p99 (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "load-tester.png", dpi=90, metadata={"Software": None})
    plt.close(fig)
