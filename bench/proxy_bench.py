"""`make bench`: our gateway against direct access and vLLM's Rust router, on one stand-in engine.

One run measures three paths to one stand-in engine (standin/; 20 ms to the first token,
then 10 ms per token, 32 tokens): `direct`, `gateway` (`python -m server serve --upstream ...`)
and `vllm-router` (PyPI `vllm-router`, round robin). The stand-in engine, this tool and the load
generator (bench/loadgen.py, its own process) run on core 0; every proxy runs on core 1
(`taskset`), so that the proxy's work is not mixed with the noise of everything else.

For each concurrency (4, 64, 128, 512 streams) and each path, interleaved, the load generator
drives that many closed-loop streams for a warm-up and a measurement window. The figures the
gateway issue asks for:
- added median time to first token at 4 streams, over direct;
- proxy CPU seconds per streamed chunk at 64 streams (its whole process tree, from /proc);
- chunks per second kept at 128 streams, as a fraction of direct;
- errors at 512 streams.
Then the trimming benchmark (bench/trim_bench.py) runs against the same stand-in engine.

Usage: python -m bench.proxy_bench --output docs/bench [--duration 8] [--paths direct,gateway]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import httpx

from bench.loadgen import summarize
from bench.procs import (
    PYTHON,
    STANDIN_MODEL,
    STANDIN_TIMING,
    Processes,
    Started,
    free_port,
    loadgen_argv,
    start_standin,
    wait_chat_ready,
)

MODEL = STANDIN_MODEL
CONCURRENCIES = (4, 64, 128, 512)
LATENCY_AT, CPU_AT, THROUGHPUT_AT, ERRORS_AT = 4, 64, 128, 512
ENGINE_CORE, PROXY_CORE = 0, 1
ALL_PATHS = ("direct", "gateway", "vllm-router")
# Published in the gateway issue for vllm-router on these machines; our goals are relative to the
# router as measured in the same run.
GOALS = {
    "added_ttft_ms_over_router": 0.3,
    "cpu_per_chunk_vs_router": 2.0,
    "throughput_kept": 0.95,
    "errors_at_512": 0,
}


def start_paths(procs: Processes, engine_url: str, paths: list[str]) -> dict[str, dict]:
    """Start the proxies; {path: {"url", "process", "command", "error"}}."""
    out: dict[str, dict] = {}
    for path in paths:
        if path == "direct":
            out[path] = {"url": engine_url, "process": None, "command": "(no proxy)", "error": None}
            continue
        port = free_port()
        if path == "gateway":
            argv = [PYTHON, "-m", "server", "serve", "--upstream", f"{MODEL}={engine_url}", "--port", str(port)]
        elif path == "vllm-router":
            router = Path(PYTHON).with_name("vllm-router")
            argv = [
                str(router), "--port", str(port), "--worker-urls", engine_url, "--policy", "round_robin",
                "--log-level", "warning",
                # its Prometheus exporter takes a fixed port by default; two routers would collide
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            ]  # fmt: skip
        else:
            raise SystemExit(f"unknown path {path!r}; known: {', '.join(ALL_PATHS)}")
        try:
            started = procs.start(path, argv, core=PROXY_CORE)
        except OSError as exc:  # e.g. vllm-router not installed
            print(f"!! {path} is not available: {exc}", file=sys.stderr)
            out[path] = {"url": None, "process": None, "command": " ".join(argv), "error": str(exc)}
            continue
        out[path] = {"url": f"http://127.0.0.1:{port}", "process": started, "command": " ".join(argv), "error": None}
    for path, info in out.items():
        if info["process"] is not None and info["error"] is None:
            info["error"] = wait_chat_ready(info["process"], info["url"], MODEL)
            if info["error"]:
                print(f"!! {path} is not available: {info['error']}", file=sys.stderr)
    return out


def run_loadgen(
    procs: Processes,
    url: str,
    concurrency: int,
    duration: float,
    warmup: float,
    cpu: dict[str, Started],
    samples: bool = False,
) -> dict:
    argv = loadgen_argv(
        url,
        concurrency=concurrency,
        duration=duration,
        warmup=warmup,
        cpu={name: started.pid for name, started in cpu.items()},
        extra=["--samples"] if samples else [],
    )
    done = subprocess.run(
        procs.pinned(ENGINE_CORE, argv), capture_output=True, text=True, timeout=duration + warmup + 120
    )
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def engine_stats(engine_url: str) -> dict:
    return httpx.get(f"{engine_url}/_standin/stats", timeout=10.0).json()


def figures(results: dict[str, dict[int, dict]], path: str) -> dict:
    """The issue's four figures for one path (None where a figure cannot be computed)."""
    direct = results.get("direct", {})
    mine = results[path]
    out: dict[str, float | int | None] = {}
    try:
        out["ttft_p50_ms_at_4"] = mine[LATENCY_AT]["ttft_ms"]["p50"]
        out["added_ttft_ms_at_4"] = mine[LATENCY_AT]["ttft_ms"]["p50"] - direct[LATENCY_AT]["ttft_ms"]["p50"]
    except (KeyError, TypeError):
        out["added_ttft_ms_at_4"] = None
    try:
        at = mine[CPU_AT]
        out["cpu_us_per_chunk_at_64"] = at["cpu_s"]["proxy"] / at["chunks"] * 1e6 if path != "direct" else None
    except (KeyError, ZeroDivisionError):
        out["cpu_us_per_chunk_at_64"] = None
    try:
        out["chunks_per_s_at_128"] = mine[THROUGHPUT_AT]["chunks_per_s"]
        out["throughput_kept_at_128"] = mine[THROUGHPUT_AT]["chunks_per_s"] / direct[THROUGHPUT_AT]["chunks_per_s"]
    except (KeyError, ZeroDivisionError):
        out["throughput_kept_at_128"] = None
    out["errors_at_512"] = mine[ERRORS_AT]["errors"] if ERRORS_AT in mine else None
    return out


def judge(ours: dict, router: dict | None) -> dict[str, bool | None]:
    """Whether the gateway meets each goal of the issue (None: not measurable in this run)."""

    def both(a, b):
        return a is not None and b is not None

    met: dict[str, bool | None] = {}
    if router and both(ours["added_ttft_ms_at_4"], router["added_ttft_ms_at_4"]):
        met["added_ttft"] = (
            ours["added_ttft_ms_at_4"] <= router["added_ttft_ms_at_4"] + GOALS["added_ttft_ms_over_router"]
        )
    else:
        met["added_ttft"] = None
    if router and both(ours["cpu_us_per_chunk_at_64"], router["cpu_us_per_chunk_at_64"]):
        met["cpu_per_chunk"] = (
            ours["cpu_us_per_chunk_at_64"] <= GOALS["cpu_per_chunk_vs_router"] * router["cpu_us_per_chunk_at_64"]
        )
    else:
        met["cpu_per_chunk"] = None
    kept = ours["throughput_kept_at_128"]
    met["throughput"] = None if kept is None else kept >= GOALS["throughput_kept"]
    errors = ours["errors_at_512"]
    met["no_errors_at_512"] = None if errors is None else errors == GOALS["errors_at_512"]
    return met


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    router_version = None
    try:
        from importlib.metadata import version

        router_version = version("vllm-router")
    except Exception:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm_router": router_version,
    }


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return commit + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def report_header() -> dict:
    """What every bench report starts with: when, which code, on what, and how busy the machine was."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "loadavg_before": loadavg(),
    }


def write_report(output: Path, stem: str, report: dict, markdown: str) -> None:
    """A bench's report as `stem`.json (every figure, for `--from-json`) and `stem`.md, both in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    (output / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (output / f"{stem}.md").write_text(markdown)


def _fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _mark(value: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[value]


def render_tables(report: dict) -> str:
    lines = ["| path | added p50 TTFT at 4 | proxy CPU per chunk at 64 | throughput kept at 128 | errors at 512 |",
             "|---|---|---|---|---|"]  # fmt: skip
    for path, fig in report["figures"].items():
        kept = fig.get("throughput_kept_at_128")
        lines.append(
            f"| {path} | {_fmt(fig.get('added_ttft_ms_at_4'), 2, ' ms')} | "
            f"{_fmt(fig.get('cpu_us_per_chunk_at_64'), 1, ' us')} | "
            f"{_fmt(None if kept is None else kept * 100, 1, ' %')} | {_fmt(fig.get('errors_at_512'))} |"
        )
    lines += ["", "| path | streams | requests/s | chunks/s | TTFT p50 / p90 / p99 ms | errors "
              "| CPU s proxy / engine / loadgen | other processes' CPU s |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path, phases in report["results"].items():
        for concurrency, result in sorted(phases.items(), key=lambda item: int(item[0])):
            ttft = result["ttft_ms"]
            cpu = result["cpu_s"]
            lines.append(
                f"| {path} | {concurrency} | {result['requests_per_s']:.1f} | {result['chunks_per_s']:.0f} | "
                f"{_fmt(ttft['p50'], 2)} / {_fmt(ttft['p90'], 2)} / {_fmt(ttft['p99'], 2)} | {result['errors']} | "
                f"{_fmt(cpu.get('proxy'), 2)} / {_fmt(cpu.get('engine'), 2)} / {_fmt(cpu.get('loadgen'), 2)} | "
                f"{_fmt(result.get('foreign_cpu_s'), 2)} in {result['window_s']:.0f} s |"
            )
    return "\n".join(lines)


def render_markdown(report: dict, trim: dict | None) -> str:
    goals = report.get("goals_met", {})
    unavailable = {path: error for path, error in report["unavailable"].items()}
    parts = [
        "# Proxy benchmark: direct vs our gateway vs vllm-router",
        "",
        f"- date: {report['date']}",
        f"- commit: {report['commit']}",
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, kernel "
        f"{report['machine']['kernel']}, Python {report['machine']['python']}, vllm-router "
        f"{report['machine']['vllm_router']}",
        f"- load average before / after: {report['loadavg_before']} / {report['loadavg_after']} "
        "(the machine is shared; figures are only comparable on a quiet machine)",
        "",
        "## Method",
        "",
        report["method"],
        "",
        "## Figures",
        "",
        render_tables(report),
        "",
        "Engine-side counts over each path's whole run (warm-ups included): "
        + "; ".join(
            f"{path}: {sum(r.get('engine_counts', {}).get('started', 0) for r in phases.values())} requests, "
            f"{sum(r.get('engine_counts', {}).get('tokenize_calls', 0) for r in phases.values())} /tokenize calls, "
            f"{sum(r.get('engine_counts', {}).get('aborted', 0) for r in phases.values())} aborted"
            for path, phases in report["results"].items()
        ),
        "",
        "## Goals (gateway issue), for the gateway",
        "",
        f"- added latency at most vllm-router's + 0.3 ms: {_mark(goals.get('added_ttft'))}",
        f"- CPU per chunk at most 2x vllm-router's: {_mark(goals.get('cpu_per_chunk'))}",
        f"- at least 95 % of direct throughput at 128 streams: {_mark(goals.get('throughput'))}",
        f"- no errors at 512 streams: {_mark(goals.get('no_errors_at_512'))}",
    ]
    if unavailable:
        parts += ["", "## Paths not measured", ""]
        parts += [f"- {path}: {error.splitlines()[0] if error else ''}" for path, error in unavailable.items()]
    if trim is not None:
        from bench.trim_bench import render_markdown as render_trim

        parts += ["", render_trim(trim, heading="##")]
    return "\n".join(parts) + "\n"


METHOD = (
    "One stand-in engine (standin/ under uvicorn + uvloop + httptools: 20 ms to the first "
    "token, then 10 ms per token, 32 tokens, so 34 SSE chunks per answer with the role chunk and the "
    "usage chunk) on core 0, with this tool and the load generator (bench/loadgen.py: one "
    "process, a raw asyncio HTTP/1.1 client on uvloop that only de-chunks and counts SSE events, one "
    "keep-alive connection per stream, closed loop). Each proxy runs alone on core 1 (`taskset -c 1`). "
    "The request is a streaming chat completion with `stream_options.include_usage`. For each "
    "number of concurrent streams the paths are measured one after the other "
    "({warmup:g} s warm-up, then a {duration:g} s window; at 4 streams {rounds} interleaved rounds "
    "of {low_window:g} s per path, their samples pooled). Time to "
    "first token: from writing the request to receiving the first content chunk. Proxy CPU: "
    "utime + stime of the proxy's whole process tree (and its reaped children) from /proc, over the "
    "window, divided by the chunks delivered in the window. Throughput: chunks per second delivered. "
    "Errors: non-200 answers, broken connections, streams without `data: [DONE]`, error events, "
    'answers slower than 60 s. "Other processes\' CPU" is the busy time of both cores (/proc/stat) '
    "minus that of the engine, the proxy and the load generator: what the rest of a shared machine "
    "took during the window; when it is not near zero the figures are noisy."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench"))
    parser.add_argument("--duration", type=float, default=8.0, help="measurement window per run, seconds")
    parser.add_argument("--low-duration", type=float, default=12.0, help="window at 4 streams, seconds")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved windows at 4 streams")
    parser.add_argument("--paths", default=",".join(ALL_PATHS), help="comma-separated: " + ", ".join(ALL_PATHS))
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--no-trim", action="store_true", help="skip the trimming benchmark")
    args = parser.parse_args(argv)
    paths = [path for path in args.paths.split(",") if path]
    if "direct" not in paths:
        paths.insert(0, "direct")
    concurrencies = [int(value) for value in args.concurrency.split(",")]
    try:
        os.sched_setaffinity(0, {ENGINE_CORE})
    except (AttributeError, OSError):
        pass
    report: dict = {
        **report_header(),
        "method": METHOD.format(
            warmup=args.warmup, duration=args.duration, rounds=args.rounds, low_window=args.low_duration / args.rounds
        ),
        "stand_in": dict(STANDIN_TIMING),
    }
    trim = None
    with Processes() as procs:
        engine, engine_url = start_standin(procs, core=ENGINE_CORE)
        error = wait_chat_ready(engine, engine_url, MODEL)
        if error:
            print(f"the stand-in engine did not start: {error}", file=sys.stderr)
            return 1
        started = start_paths(procs, engine_url, paths)
        report["commands"] = {path: info["command"] for path, info in started.items()}
        report["unavailable"] = {path: info["error"] for path, info in started.items() if info["error"]}
        live = [path for path in paths if not started[path]["error"]]
        results: dict[str, dict[int, dict]] = {path: {} for path in live}
        for concurrency in concurrencies:
            # Low load: several short windows per path, interleaved, so that drift of a shared
            # machine hits every path alike; the TTFT samples are pooled.
            rounds = args.rounds if concurrency == LATENCY_AT else 1
            duration = args.low_duration / rounds if concurrency == LATENCY_AT else args.duration
            windows: dict[str, list[dict]] = {path: [] for path in live}
            for _ in range(rounds):
                for path in live:
                    cpu = {"engine": engine}
                    if started[path]["process"] is not None:
                        cpu["proxy"] = started[path]["process"]
                    before = engine_stats(engine_url)
                    window = run_loadgen(
                        procs, started[path]["url"], concurrency, duration, args.warmup, cpu, rounds > 1
                    )
                    after = engine_stats(engine_url)
                    # what the proxy made the engine do besides generating (whole run, not the window)
                    window["engine_counts"] = {
                        key: after[key] - before[key] for key in ("tokenize_calls", "aborted", "started")
                    }
                    windows[path].append(window)
            for path in live:
                result = summarize(windows[path])
                result["engine_counts"] = {
                    key: sum(window["engine_counts"][key] for window in windows[path])
                    for key in ("tokenize_calls", "aborted", "started")
                }
                result.pop("ttft_samples_ms", None)
                results[path][concurrency] = result
                print(
                    f"{path:>12} {concurrency:>4} streams: {result['chunks_per_s']:7.0f} chunks/s, "
                    f"TTFT p50 {_fmt(result['ttft_ms']['p50'], 2)} ms, errors {result['errors']}, "
                    f"CPU {result['cpu_s']}",
                    flush=True,
                )
        report["results"] = results
        report["figures"] = {path: figures(results, path) for path in live}
        report["goals_met"] = (
            judge(report["figures"]["gateway"], report["figures"].get("vllm-router"))
            if "gateway" in report["figures"]
            else {}
        )
        if not args.no_trim:
            from bench import trim_bench

            trim = trim_bench.run(procs, engine, engine_url)
    report["loadavg_after"] = loadavg()
    write_report(args.output, "proxy", {**report, "trimming": trim}, render_markdown(report, trim))
    print()
    print(render_tables(report))
    if trim is not None:
        from bench.trim_bench import summary_line

        print()
        print(summary_line(trim))
    print(f"\nload average before / after: {report['loadavg_before']} / {report['loadavg_after']}")
    print(f"written: {args.output / 'proxy.json'}, {args.output / 'proxy.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
