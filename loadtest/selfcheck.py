"""Measures the load tester itself against a stand-in engine: `python -m loadtest.selfcheck`.

For each closed-loop concurrency it runs short single-turn streams against a server with
`/_standin/timings` (`python -m standin`), joins every request with the engine's own
timings (`loadtest.overhead`) and reports the load tester's added TTFT (p50, p99); for each
open-loop rate (constant arrivals) it reports the achieved send rate against the target.
Every level runs every client configuration back to back (`--http-client raw,httpx` x
`--gc frozen,default`), so one run compares them under the same machine. Each row also says
where the time went: the client's CPU, its run-queue wait (ready to run while other processes
held the CPU), its longest GC pause, and with `--server-pid` the stand-in's CPU and run-queue
wait (`loadtest.process_stats`). Results go to `DIR/overhead.json` (one entry per `--label`,
so before/after runs accumulate) and `DIR/overhead.md` (the table over every label).

Pin the two processes to different cores so that they do not measure each other (and, on a
shared machine, see loadtest/results/client-overhead/bench.sh for `chrt`/autogroup nice):

    taskset -c 1 python -m standin --port 8200 --ttft-ms 50 --itl-ms 25 --tokens 16 &
    taskset -c 0 python -m loadtest.selfcheck --url http://127.0.0.1:8200 --label after \\
        --server-pid $! --gc default,frozen --output loadtest/results/client-overhead
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import subprocess
from pathlib import Path

import httpx

from loadtest import aio, scenarios
from loadtest.client import HTTP_CLIENTS, ChatClient, make_transport
from loadtest.loop_lag import saturation
from loadtest.metrics import describe, percentile
from loadtest.overhead import fetch_engine_timings, overhead_summary
from loadtest.process_stats import ProcessSample
from loadtest.runner import LoadShape, Runner, StopRule

GC_MODES = ("frozen", "default")
CLIENT_NAMES = {"raw": "loadtest.transport (asyncio + httptools)", "httpx": "httpx AsyncClient (httpcore pool)"}


async def _one_run(args, config: tuple[str, str], shape: LoadShape, stop: StopRule, control) -> dict:
    kind, gc_mode = config
    base = args.url.rstrip("/")
    (await control.delete(f"{base}/_standin/timings")).raise_for_status()
    pool = shape.concurrency or 4096
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    server_before = ProcessSample.take(args.server_pid) if args.server_pid else None
    async with make_transport(kind, max_connections=pool, timeout_s=args.timeout) as http:
        client = ChatClient(base, http=http, model=args.model, timeout_s=args.timeout)
        sessions = scenarios.random_prompts(args.seed, input_chars=args.input_chars, max_tokens=args.max_tokens)
        runner = Runner(client, sessions, shape, stop, run=shape.label, freeze_gc=gc_mode == "frozen")
        result = await runner.run()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    server = ProcessSample.take(args.server_pid).since(server_before) if server_before else {}
    cpu_s = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    engine = await fetch_engine_timings(f"{base}/_standin/timings", control)
    measured = result.measured
    ok = [r for r in measured if r.ok]
    row = {
        "client": kind,
        "gc": gc_mode,
        "load": shape.to_json(),
        "requests": len(measured),
        "failed": len(measured) - len(ok),
        **overhead_summary(measured, engine, origin=result.origin),
    }
    row["client_cpu_s"] = cpu_s
    row["client_cpu_per_request_ms"] = cpu_s / len(result.records) * 1000
    row["client_cpu_share"] = cpu_s / result.wall_s
    row["client_run_queue_wait_share"] = result.process.get("generator_run_queue_wait_share")
    row.update({k: v for k, v in result.process.items() if k.startswith("gc_")})
    row["server_cpu_share"] = server.get("cpu_share")
    row["server_run_queue_wait_share"] = server.get("run_queue_wait_share")
    engine_ttfts = [t["ttft_s"] for r in ok if (t := engine.get(r.request_id)) and t.get("ttft_s")]
    row["median_engine_ttft_ms"] = percentile(engine_ttfts, 50) * 1000
    row["p99_engine_ttft_ms"] = percentile(engine_ttfts, 99) * 1000
    ttft = describe([r.ttft_s for r in ok if r.ttft_s is not None])
    row["median_ttft_ms"] = ttft.get("median", math.nan) * 1000
    sent = sorted(r.sent_s for r in measured)
    span = sent[-1] - sent[0] if len(sent) > 1 else math.nan
    row["send_rate"] = (len(sent) - 1) / span if span and span > 0 else math.nan
    row["warnings"] = saturation(
        {**result.loop_lag, **result.process, "achieved_rate": row["send_rate"]}, target_rate=shape.rate
    )
    row["p99_lateness_ms"] = percentile([r.lateness_s for r in measured], 99) * 1000
    row["loop_lag"] = result.loop_lag
    return row


async def run(args) -> list[dict]:
    """Every load level with every client configuration (HTTP client x GC mode), back to back
    per level (alternating which goes first), so that a shared machine's drifts hit them alike."""
    levels = []
    for concurrency in args.concurrency:
        count = max(args.min_requests, args.requests_per_stream * concurrency)
        levels.append((LoadShape(concurrency=concurrency), StopRule(num_requests=count, warmup_requests=concurrency)))
    for rate in args.rate:
        count = max(args.min_requests, int(rate * args.rate_seconds))
        levels.append(
            (LoadShape(rate=rate, arrival="constant"), StopRule(num_requests=count, warmup_requests=int(rate * 0.5)))
        )
    rows = []
    async with httpx.AsyncClient(trust_env=False) as control:
        for index, (shape, stop) in enumerate(levels):
            configs = [(kind, gc_mode) for kind in args.http_client for gc_mode in args.gc]
            for config in configs if index % 2 == 0 else configs[::-1]:
                rows.append(await _one_run(args, config, shape, stop, control))
                _print(rows[-1])
    return rows


def _print(row: dict) -> None:
    load = row["load"]
    print(
        f"{row['client']:>5} {row['gc']:>7} GC {load['label']:>28}: {row['requests']} req, "
        f"failed {row['failed']}, added TTFT "
        f"p50 {row['median_added_ttft_ms']:.2f} ms p99 {row['p99_added_ttft_ms']:.2f} ms, "
        f"send rate {row['send_rate']:.1f}/s; legs p50 send "
        f"{row.get('median_send_leg_ms', math.nan):.2f} receive "
        f"{row.get('median_receive_leg_ms', math.nan):.2f} ms; loop lag p99 "
        f"{(row.get('loop_lag') or {}).get('p99_loop_lag_ms', math.nan):.1f} ms; CPU "
        f"{row['client_cpu_share']:.2f} core, waited {_fmt(row['client_run_queue_wait_share'])}; GC "
        f"{row['gc_collections']} ({row['gc_full_collections']} full) max {row['gc_pause_max_ms']:.1f} ms "
        f"{[round(x, 1) for x in row['gc_pause_max_ms_by_generation']]}; "
        f"engine TTFT p99 {row['p99_engine_ttft_ms']:.1f} ms, server CPU {_fmt(row['server_cpu_share'])} "
        f"waited {_fmt(row['server_run_queue_wait_share'])}",
        flush=True,
    )


def _fmt(value, digits=2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(document: dict) -> str:
    """The tables over every label in `document` (closed-loop added time; open-loop rates)."""
    lines = [
        "# The load tester's own added time, measured against the stand-in engine",
        "",
        (
            "Written by `python -m loadtest.selfcheck`. added TTFT = the load tester's TTFT - "
            "the engine-side TTFT of the same request (joined by `x-request-id`). It includes "
            "the loopback both ways and the stand-in's HTTP parsing, so it bounds the load "
            "tester's own share from above. Client CPU per request includes the idle "
            "event loop's timers, which dominate at low rates."
        ),
        "",
    ]
    for label, entry in document["labels"].items():
        lines += [
            f"## {label}",
            "",
            f"- {entry['when']}, {entry['machine']}",
            f"- command: `{entry['command']}`",
            f"- `uptime` before: {entry['uptime']}",
            f"- `uptime` after: {entry.get('uptime_after', '-')}",
            f"- event loop: {entry['loop']}; clients: "
            + "; ".join(f"`{k}` = {v}" for k, v in entry["clients"].items()),
            "",
        ]
        lines += [
            (
                "| client | GC | streams | requests | failed | TTFT p50 (ms) | engine TTFT p50 / p99 (ms) | "
                "**added TTFT p50 (ms)** | **added TTFT p99 (ms)** | send leg p50 / p99 | "
                "receive leg p50 / p99 | added E2E p50 (ms) | loop lag p99 (ms) | "
                "client CPU per request (ms) | client CPU share of a core | client waiting for a CPU | "
                "longest GC pause (ms) | stand-in CPU / waiting |"
            ),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in entry["rows"]:
            if row["load"]["rate"] is not None:
                continue
            lag = (row.get("loop_lag") or {}).get("p99_loop_lag_ms")
            lines.append(
                f"| {row['client']} | {row.get('gc', 'default')} | {row['load']['concurrency']} | "
                f"{row['requests']} | {row['failed']} | "
                f"{_fmt(row['median_ttft_ms'])} | {_fmt(row['median_engine_ttft_ms'])} / "
                f"{_fmt(row.get('p99_engine_ttft_ms'))} | "
                f"**{_fmt(row['median_added_ttft_ms'])}** | **{_fmt(row['p99_added_ttft_ms'])}** "
                f"| {_fmt(row.get('median_send_leg_ms'))} / {_fmt(row.get('p99_send_leg_ms'))} "
                f"| {_fmt(row.get('median_receive_leg_ms'))} / "
                f"{_fmt(row.get('p99_receive_leg_ms'))} "
                f"| {_fmt(row['median_added_e2el_ms'])} | {_fmt(lag)} "
                f"| {_fmt(row.get('client_cpu_per_request_ms'), 3)} "
                f"| {_fmt(row.get('client_cpu_share'), 2)} | {_fmt(row.get('client_run_queue_wait_share'))} "
                f"| {_fmt(row.get('gc_pause_max_ms'))} "
                f"| {_fmt(row.get('server_cpu_share'))} / {_fmt(row.get('server_run_queue_wait_share'))} |"
            )
        rates = [row for row in entry["rows"] if row["load"]["rate"] is not None]
        if rates:
            lines += [
                "",
                (
                    "| client | GC | target rate (req/s, constant) | requests | achieved send rate | "
                    "achieved / target | lateness p99 (ms) | added TTFT p50 (ms) | "
                    "p99 (ms) | loop lag p99 (ms) | client waiting for a CPU |"
                ),
                "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for row in rates:
                target = row["load"]["rate"]
                lines.append(
                    f"| {row['client']} | {row.get('gc', 'default')} | {target:g} | {row['requests']} | "
                    f"{_fmt(row['send_rate'], 1)} | "
                    f"{_fmt(row['send_rate'] / target, 3)} | {_fmt(row['p99_lateness_ms'])} | "
                    f"{_fmt(row['median_added_ttft_ms'])} | {_fmt(row['p99_added_ttft_ms'])} | "
                    f"{_fmt((row.get('loop_lag') or {}).get('p99_loop_lag_ms'))} | "
                    f"{_fmt(row.get('client_run_queue_wait_share'))} |"
                )
        lines.append("")
    return "\n".join(lines)


def _uptime() -> str:
    """`uptime`'s line (the load average that the figures were measured under)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "-"


def _clients(text: str) -> list[str]:
    clients = [x.strip() for x in text.split(",") if x.strip()]
    if not clients or set(clients) - set(HTTP_CLIENTS):
        raise argparse.ArgumentTypeError(f"HTTP clients are {', '.join(HTTP_CLIENTS)}")
    return clients


def _gc_modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    if not modes or set(modes) - set(GC_MODES):
        raise argparse.ArgumentTypeError(f"GC modes are {', '.join(GC_MODES)}")
    return modes


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="a stand-in engine (standin)")
    parser.add_argument("--model", default="standin")
    parser.add_argument("--label", required=True, help="this measurement's name (before, after)")
    parser.add_argument("--output", default="loadtest/results/client-overhead")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 32, 128, 256])
    parser.add_argument("--rate", type=_floats, default=[])
    parser.add_argument("--rate-seconds", type=float, default=5.0, help="measured requests per rate = rate x this")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=200)
    parser.add_argument("--input-chars", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument(
        "--http-client", type=_clients, default=["raw"], help="comma-separated, run back to back per level (raw, httpx)"
    )
    parser.add_argument("--loop", choices=aio.LOOPS, default="auto")
    parser.add_argument(
        "--gc",
        type=_gc_modes,
        default=["frozen"],
        help="comma-separated: frozen (the runner's default) and/or default (the interpreter's), back to back",
    )
    parser.add_argument(
        "--server-pid", type=int, help="the stand-in's process id: its CPU and run-queue wait per run (same host)"
    )
    args = parser.parse_args(argv)
    uptime = _uptime()
    rows = aio.run(run(args), args.loop)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    path = output / "overhead.json"
    document = json.loads(path.read_text()) if path.exists() else {"labels": {}}
    document["labels"][args.label] = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "python -m loadtest.selfcheck " + " ".join(argv or os.sys.argv[1:]),
        "uptime": uptime,
        "uptime_after": _uptime(),
        "clients": {c: CLIENT_NAMES[c] for c in args.http_client},
        "loop": aio.loop_name(args.loop),
        "rows": rows,
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    (output / "overhead.md").write_text(markdown(document))
    print(f"wrote {output}/overhead.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
