"""What the flow gate costs when the engines have room: CPU per streamed chunk and added time to
first token, the gate on against the gate off, side by side (issue 32: within 1.03x, +0.05 ms).

The method is bench/workers_bench.py's `--side-by-side` (its functions are used as they are):
one stand-in engine (standin/: 20 ms to the first token, 10 ms per token), two gateways of this
commit's code with the same two tenants, each `--workers 1` on core 1, one with `flow.enabled:
false`; the load generators and the engine on core 0. In each window both gateways relay their
own load generator's streams in the same seconds (a shared machine's drift moves both alike):
`--rounds` windows at 64 streams for CPU per chunk (each gateway's process, from /proc; the
ratio gate-on / gate-off round by round and its median), then as many at 4 streams with
`direct` for the added TTFT (samples pooled; gate-on minus gate-off), then the paired TTFT
(`--paired`, bench.paired: one client on core 0 asks each gateway in turn; the pooled p50s move
by a tenth of a millisecond from run to run, the paired median by a few microseconds). The gate never holds here:
the stand-in's model has no profile, so its capacity is vLLM's default 256 per engine, far above
64 streams; every request still passes through it (class, cost estimate, counters, settlement).

Usage: python -m bench.fairness_cost --output docs/bench/fairness [--rounds 6] [--duration 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import median
from typing import Any

from bench.procs import PYTHON, ROOT, Processes, commit_of, free_port, start_standin
from bench.proxy_bench import MODEL
from bench.workers_bench import (
    TENANT_KEY,
    TENANTS_CONFIG,
    _wait_ready_with_key,
    paired_between,
    side_by_side_figures,
    side_by_side_rounds,
    side_by_side_ttft,
)

OFF, ON = "gate off", "gate on"


def start_gateways(procs: Processes, engine_url: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"direct": {"url": engine_url, "process": None, "cores": "0"}}
    for path, flow in ((OFF, {"enabled": False}), (ON, {"enabled": True})):
        config = procs.log_dir / f"{path.replace(' ', '-')}.gateway.json"
        config.write_text(json.dumps({**TENANTS_CONFIG, "flow": flow}))
        port = free_port()
        argv = [PYTHON, "-P", "-m", "server", "serve", "--upstream", f"{MODEL}={engine_url}", "--port", str(port),
                "--workers", "1", "--config", str(config)]  # fmt: skip
        started = procs.start(path.replace(" ", "-"), ["taskset", "-c", "1", *argv], core=None,
                              env={"PYTHONPATH": str(ROOT)})  # fmt: skip
        out[path] = {
            "url": f"http://127.0.0.1:{port}",
            "process": started,
            "cores": "0",
            "loadgen_env": {"LOADGEN_API_KEY": TENANT_KEY},
            "command": " ".join(argv),
        }
    for path in (OFF, ON):
        error = _wait_ready_with_key(out[path], timeout=120)
        if error:
            raise SystemExit(f"{path} is not available: {error}")
    return out


def render(report: dict[str, Any]) -> str:
    cpu, ttft = report["cpu"], report["ttft"]
    rounds = ", ".join(f"{r:.3f}" for r in cpu["ratio_rounds"] if r is not None)
    added = ttft["minus_first_ms"][ON]
    added_rounds = ", ".join(f"{r:+.3f}" for r in ttft["minus_first_rounds_ms"][ON] if r is not None)
    return "\n".join(
        [
            "# The flow gate's cost when the engines have room (side by side, gate on vs off)",
            "",
            f"Commit {report['commit']}; {os.cpu_count()} CPUs shared with other agents' work "
            f"(load average before: {', '.join(f'{x:.1f}' for x in report['load_before'])}).",
            "Method: bench/workers_bench.py's side-by-side windows (both gateways in the same seconds).",
            "",
            "| figure | value | goal |",
            "|---|---|---|",
            f"| CPU per chunk, gate on / gate off, at 64 streams (median of {len(cpu['ratio_rounds'])} rounds) "
            f"| {cpu['ratio_median']:.3f} (rounds {rounds}) | <= 1.03 |",
            f"| added p50 TTFT, gate on minus gate off, at 4 streams (pooled) | {added:+.3f} ms "
            f"(rounds {added_rounds}) | <= +0.05 ms |",
            *_paired_row(report.get("paired_ttft")),
            f"| p50 TTFT direct / gate off / gate on (ms) | {ttft['p50_ms']['direct']:.3f} / "
            f"{ttft['p50_ms'][OFF]:.3f} / {ttft['p50_ms'][ON]:.3f} | |",
            f"| errors | {cpu['errors'] + ttft['errors']} | 0 |",
            "",
        ]
    )


def _paired_row(paired: dict[str, Any] | None) -> list[str]:
    if not paired:
        return []
    low, _, high = paired["diff_quartiles_us"]
    return [
        f"| paired TTFT, gate on minus gate off (bench.paired: one client, one streamed request at a time, "
        f"{paired['pairs']} pairs) | {paired['median_diff_us']:+.1f} us (quartiles {low:+.1f} .. {high:+.1f}) "
        "| <= +50 us |"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/bench/fairness")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--low-duration", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--name", default="fairness-cost")
    parser.add_argument("--paired", type=int, default=1000, help="pairs of the paired TTFT, gate off then on (0: none)")
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    procs = Processes()
    report: dict[str, Any] = {"commit": commit_of("HEAD"), "load_before": os.getloadavg(), "args": vars(args)}
    try:
        engine, engine_url = start_standin(procs, core=0)
        paths = start_gateways(procs, engine_url)

        def show(window: dict) -> str:
            return f"{window.get('chunks', 0)} chunks"

        cpu_windows = side_by_side_rounds(
            engine, {p: paths[p] for p in (OFF, ON)}, args.rounds, 64, args.duration, args.warmup, show=show
        )
        report["cpu"] = side_by_side_figures(cpu_windows, [OFF, ON])
        ttft_windows = side_by_side_rounds(
            engine,
            {p: paths[p] for p in ("direct", OFF, ON)},
            args.rounds,
            4,
            args.low_duration / 2,
            args.warmup,
            show=lambda w: f"p50 {w['ttft_ms']['p50']}",
            samples=True,
        )
        report["ttft"] = side_by_side_ttft(ttft_windows, [OFF, ON])
        if args.paired:
            report["paired_ttft"] = paired_between(paths, [OFF, ON], args.paired)
        for windows in (cpu_windows, ttft_windows):
            for window in windows:
                for result in window.values():
                    result.pop("ttft_samples_ms", None)  # pooled above; the windows' summaries stay
        report["windows"] = {"cpu": cpu_windows, "ttft": ttft_windows}
        report["cpu_us_per_chunk_median"] = {
            p: median(r[p] for r in report["cpu"]["cpu_us_per_chunk_rounds"] if r[p] is not None) for p in (OFF, ON)
        }
    finally:
        procs.close()
    (output / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    (output / f"{args.name}.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
