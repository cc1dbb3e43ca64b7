"""Where the gateway's CPU goes per streamed chunk: a py-spy profile of the relay, as a flame graph and a table.

The stand-in engine (20 ms to the first token, 10 ms per token, 32 tokens) and the load generator
run on core 0, the gateway (`python -m server serve`, one worker) alone on core 1. While 64
streams run, py-spy samples the gateway twice (raw stacks for the table, then the SVG flame
graph; idle samples left out). The table puts each sample under the first owner found anywhere
in its stack (the access log, metrics, trimming, routing, the SSE scan, the upstream client...),
else under the innermost layer (uvicorn, JSON, the relay loop, the event loop), and turns shares
into microseconds per chunk with the gateway's CPU per chunk measured by the load generator over
the same stretch. On a busy machine a sample may be taken while the gateway waits for its core:
shares then weigh time, not only CPU, alike for every category.

With `--max-tokens N` the answers are N tokens long (files `relay-profile-N-tokens.*`,
`relay-flame-N-tokens.svg`): short answers put what a request costs, paid once per answer, in
the foreground (the table's last column).

Needs py-spy (`pip install py-spy`) and the right to trace a child process (root, or
kernel.yama.ptrace_scope 0). Usage: python -m bench.relay_profile --output docs/bench [--seconds 20]
[--max-tokens N]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.procs import PYTHON, STANDIN_MODEL, Processes, free_port, loadgen_argv, start_standin, wait_chat_ready

MODEL = STANDIN_MODEL
STREAMS = 64
# A sample belongs to the first of these whose pattern matches any frame of its stack (what the
# code was doing on behalf of: a JSON encode inside the access log is the access log's)...
OWNERS = (
    ("idle worker threads (waiting)", r"_worker \(.*concurrent/futures/thread\.py"),
    ("access log: JSON line per request (observability.logs, logging)", r"observability/logs\.py|/logging/"),
    ("request metrics (observability.metrics, prometheus_client)", r"observability/metrics\.py|prometheus_client/"),
    ("request report (observability.record)", r"observability/record\.py"),
    ("trimming step (trimming)", r"gateway/trimming/"),
    ("routing and scoring (replicas)", r"gateway/replicas/"),
    ("SSE scanning for usage/tokens (http.sse, streams)", r"http/sse\.py|http/streams\.py"),
    # The splice runs the relay's per-chunk work and the client's socket write inside the upstream
    # connection's callbacks: those are the relay's and the client side's, not the upstream client's.
    ("client-side socket writes of the spliced stream (http.seam writers)", r"ChunkedWriter|SendWriter"),
    ("relay loop and exchange (proxy.exchange, proxy.proxy)", r"_relay_stream\.<locals>\.sink"),
    ("upstream HTTP/1.1 client (proxy.transport, http1)", r"proxy/transport\.py|http1/"),
    ("deadlines (proxy.deadlines)", r"proxy/deadlines\.py"),
    ("request parsing, auth, routing table (request, app.auth)", r"gateway/request/|gateway/app/auth"),
)
# ...else to the first of these met from the innermost frame outwards (every request runs under
# uvicorn's run_asgi: only what uvicorn itself does is uvicorn's).
LAYERS = (
    ("client-side HTTP and ASGI send (uvicorn httptools protocol)", r"uvicorn/"),
    ("JSON (jsonio, json)", r"jsonio\.py|/json/"),
    ("relay loop and exchange (proxy.exchange, proxy.proxy)", r"proxy/exchange\.py|proxy/proxy\.py|proxy/fanout"),
    ("ASGI router (app.router)", r"app/router\.py"),
    ("event loop, sockets, C code under uvloop (self time)", r"Runner\.run|uvloop/__init__|runners\.py"),
)


def category(frames: list[str]) -> str:
    """The category of one sampled stack (frames from the outermost to the innermost)."""
    for name, pattern in OWNERS:
        if any(re.search(pattern, frame) for frame in frames):
            return name
    for frame in reversed(frames):
        for name, pattern in LAYERS:
            if re.search(pattern, frame):
                return name
    return "other"


def categorize(raw: str) -> tuple[collections.Counter[str], int]:
    """Samples per category from py-spy's raw (collapsed) output; and the total."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if stack and number.isdigit():
            total += int(number)
            counts[category(stack.split(";"))] += int(number)
    return counts, total


def _names(max_tokens: int | None) -> tuple[str, str]:
    """The report's file stem and the flame graph's file name."""
    suffix = f"-{max_tokens}-tokens" if max_tokens else ""
    return f"relay-profile{suffix}", f"relay-flame{suffix}.svg"


def render_markdown(report: dict) -> str:
    counts, busy, cpu_us = report["categories"], report["busy_samples"], report["cpu_us_per_chunk"]
    per_request = report.get("cpu_us_per_request")
    answers = f"answers of {report.get('max_tokens') or 32} tokens"
    flame = _names(report.get("max_tokens"))[1]
    lines = [
        "# The relay's CPU per chunk, by where it goes (py-spy)",
        "",
        f"- date: {report['date']}; commit: {report['commit']}; load average before / after: "
        f"{report['loadavg_before']} / {report['loadavg_after']} (a shared machine)",
        f"- {STREAMS} streams ({answers}) for {report['seconds']:g} s; gateway CPU per chunk over that "
        f"stretch: {cpu_us:.1f} us ({report['chunks']} chunks, {report['gateway_cpu_s']:.2f} CPU s)"
        + (f", per request {per_request:.0f} us ({report['requests']} requests)" if per_request else "")
        + f"; {busy} busy samples at {report['rate']} Hz",
        f"- flame graph: [{flame}]({flame}) (idle time left out)",
        "",
        (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\nNeeds py-spy", 1)[0],
        "",
        "| where | share of busy samples | us per chunk | us per request |",
        "|---|---|---|---|",
    ]
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        if name.startswith("idle"):
            continue
        share = count / busy if busy else 0.0
        request = f"{share * per_request:.1f}" if per_request else "n/a"
        lines.append(f"| {name} | {share * 100:.1f} % | {share * cpu_us:.1f} | {request} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from bench.proxy_bench import git_commit, loadavg, write_report

    parser = argparse.ArgumentParser(prog="python -m bench.relay_profile", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--max-tokens", type=int, help="answers of this many tokens (default: the stand-in's 32)")
    args = parser.parse_args(argv)
    stem, flame = _names(args.max_tokens)
    shorter = ["--body-extra", json.dumps({"max_tokens": args.max_tokens})] if args.max_tokens else []
    py_spy = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    report: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
                    "loadavg_before": loadavg(), "seconds": args.seconds, "rate": args.rate,
                    "max_tokens": args.max_tokens}  # fmt: skip
    args.output.mkdir(parents=True, exist_ok=True)
    with Processes() as procs:
        port = free_port()
        engine, engine_url = start_standin(procs, core=0)
        gateway = procs.start(
            "gateway", [PYTHON, "-m", "server", "serve", "--upstream", f"{MODEL}={engine_url}", "--port", str(port)],
            core=1,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        for started, where in ((engine, engine_url), (gateway, url)):
            if error := wait_chat_ready(started, where, MODEL, timeout=120):
                print(f"{started.name} did not start: {error}", file=sys.stderr)
                return 1
        warmup = 3.0
        load = subprocess.Popen(
            procs.pinned(0, loadgen_argv(url, concurrency=STREAMS, duration=2 * args.seconds + 1, warmup=warmup,
                                         cpu={"proxy": gateway.pid}, extra=shorter)),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(warmup)
        raw = procs.log_dir / "relay-profile.raw.txt"  # kept with the processes' logs, for a closer look
        common = ["--pid", str(gateway.pid), "--rate", str(args.rate), "--duration", str(int(args.seconds))]
        subprocess.run([py_spy, "record", *common, "--format", "raw", "-o", str(raw)], check=True, capture_output=True)
        svg = args.output / flame
        subprocess.run([py_spy, "record", *common, "--format", "flamegraph", "-o", str(svg)], check=True,
                       capture_output=True)  # fmt: skip
        out, _ = load.communicate(timeout=args.seconds * 2 + 120)
    window = json.loads(out)
    counts, total = categorize(raw.read_text())
    print(f"raw stacks: {raw}")
    idle = sum(count for name, count in counts.items() if name.startswith("idle"))
    report.update(
        loadavg_after=loadavg(),
        categories=dict(counts),
        busy_samples=total - idle,
        chunks=window["chunks"],
        gateway_cpu_s=window["cpu_s"]["proxy"],
        cpu_us_per_chunk=window["cpu_s"]["proxy"] / window["chunks"] * 1e6,
        requests=window["requests_started"],
        cpu_us_per_request=window["cpu_s"]["proxy"] / window["requests_started"] * 1e6,
    )
    text = render_markdown(report)
    write_report(args.output, stem, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
