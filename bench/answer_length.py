"""CPU per chunk and per request: the gateway and vllm-router at several answer lengths.

A proxy pays some of its work once per request (reading, checking and routing the request, the
response head, the end of the stream, the access log and the request's metrics) and the rest once
per streamed chunk (a read from the engine, a write to the client, the token and usage scans), so
its CPU per chunk depends on how long the answers are. One stand-in engine (standin/: 20
ms to the first token, then 10 ms per token) answers `max_tokens` tokens: 8, 32, 96 and 320 (an
answer's chunks: its tokens, the role, the finish reason with the usage, and `[DONE]`). 64 streams
run through each proxy, pinned to core 1 (the engine and the load generator on core 0), in
interleaved rounds; the streams start spread over one answer's time, so that answers do not start
and end in waves across the window. Per proxy, a least-squares fit over every window of its CPU
seconds, `cpu = a * chunks + b * requests`, splits its cost into
`a` per chunk and `b` per request; `1 / (a + b / n)` is what one busy core relays at answers of
n chunks: the figure to size a gateway for a workload's answer length.

Usage: python -m bench.answer_length --output docs/bench [--duration 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.procs import STANDIN_TIMING, Processes, start_standin, wait_chat_ready
from bench.proxy_bench import MODEL, loadavg, report_header, write_report
from bench.workers_bench import CpuCaps, run_window, start_paths

PATHS = ("vllm-router", "gateway x1")
ANSWER_TOKENS = (8, 32, 96, 320)
STREAMS = 64


def fit(windows: list[dict]) -> dict:
    """Least squares of the proxy's CPU seconds over chunks and requests, through the origin:
    `a` us per chunk, `b` us per request, and how far the fit is from the windows (relative RMS).
    Requests are those sent in the window: with answers longer than a window, fewer are both sent
    and answered in it than the proxy handled."""
    rows = [(w["chunks"], w["requests_started"], w["cpu_s"]["proxy"]) for w in windows if w["cpu_s"].get("proxy")]
    scc = sum(c * c for c, _, _ in rows)
    scr = sum(c * r for c, r, _ in rows)
    srr = sum(r * r for _, r, _ in rows)
    scy = sum(c * y for c, _, y in rows)
    sry = sum(r * y for _, r, y in rows)
    det = scc * srr - scr * scr
    if len(rows) < 2 or det <= 0:
        return {"a_us_per_chunk": None, "b_us_per_request": None, "relative_rms": None, "windows": len(rows)}
    a = (scy * srr - sry * scr) / det
    b = (scc * sry - scr * scy) / det
    errors = [((a * c + b * r) - y) / y for c, r, y in rows]
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    return {"a_us_per_chunk": a * 1e6, "b_us_per_request": b * 1e6, "relative_rms": rms, "windows": len(rows)}


def per_length(windows: list[dict]) -> dict[int, dict]:
    """CPU per chunk and chunks per request measured at each answer length (windows pooled)."""
    out: dict[int, dict] = {}
    for tokens in sorted({w["max_tokens"] for w in windows}):
        mine = [w for w in windows if w["max_tokens"] == tokens]
        chunks = sum(w["chunks"] for w in mine)
        requests = sum(w["requests_started"] for w in mine)
        cpu = sum(w["cpu_s"].get("proxy") or 0.0 for w in mine)
        system = [w.get("system_cpu_s", {}).get("proxy") for w in mine]
        out[tokens] = {
            "cpu_us_per_chunk": cpu / chunks * 1e6 if chunks else None,
            "system_us_per_chunk": sum(system) / chunks * 1e6 if chunks and None not in system else None,
            "chunks_per_request": chunks / requests if requests else None,
            "rounds_cpu_us_per_chunk": [
                w["cpu_s"]["proxy"] / w["chunks"] * 1e6 for w in mine if w["chunks"] and w["cpu_s"].get("proxy")
            ],
            "errors": sum(w["errors"] for w in mine),
        }
    return out


def chunks_per_core_second(a_us: float | None, b_us: float | None, chunks_per_answer: float) -> float | None:
    if a_us is None or b_us is None:
        return None
    return 1e6 / (a_us + b_us / chunks_per_answer)


def _ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None or y == 0 else x / y


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def render_markdown(report: dict) -> str:
    fits, lengths = report["fits"], report["lengths"]
    gateway, router = fits.get("gateway x1", {}), fits.get("vllm-router", {})
    lines = [
        "# CPU per chunk and per request, by answer length: the gateway beside vllm-router",
        "",
        f"- date: {report['date']}; commit: {report['commit']}",
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, Python "
        f"{report['machine']['python']}, vllm-router {report['machine']['vllm_router']}",
        f"- load average before / after: {report['loadavg_before']} / {report['loadavg_after']} (a shared machine)",
        "",
        "## Method",
        "",
        (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\nUsage:", 1)[0],
        "",
        "## Figures",
        "",
        "| answer tokens | chunks per answer | vllm-router CPU per chunk | gateway CPU per chunk | gateway / router "
        "| of which the kernel's (system calls, network stack): router / gateway | rounds: router; gateway (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for tokens in sorted({int(t) for path in lengths.values() for t in path}):
        r, g = lengths.get("vllm-router", {}).get(tokens, {}), lengths.get("gateway x1", {}).get(tokens, {})
        rounds = "; ".join(", ".join(f"{v:.1f}" for v in side.get("rounds_cpu_us_per_chunk", [])) for side in (r, g))
        lines.append(
            f"| {tokens} | {_fmt(g.get('chunks_per_request') or r.get('chunks_per_request'), 1)} | "
            f"{_fmt(r.get('cpu_us_per_chunk'), 1, ' us')} | {_fmt(g.get('cpu_us_per_chunk'), 1, ' us')} | "
            f"{_fmt(_ratio(g.get('cpu_us_per_chunk'), r.get('cpu_us_per_chunk')), 2, 'x')} | "
            f"{_fmt(r.get('system_us_per_chunk'), 1, ' us')} / {_fmt(g.get('system_us_per_chunk'), 1, ' us')} | "
            f"{rounds} |"
        )
    lines += [
        "",
        "| proxy | a: CPU per chunk | b: CPU per request | fit's relative RMS error | chunks per core-second at "
        "answers of 34 / 98 / 322 chunks |",
        "|---|---|---|---|---|",
    ]
    for path, f in fits.items():
        per_core = " / ".join(
            _fmt(chunks_per_core_second(f["a_us_per_chunk"], f["b_us_per_request"], n), 0) for n in (34, 98, 322)
        )
        lines.append(
            f"| {path} | {_fmt(f['a_us_per_chunk'], 1, ' us')} | {_fmt(f['b_us_per_request'], 0, ' us')} | "
            f"{_fmt(f['relative_rms'] and f['relative_rms'] * 100, 1, ' %')} | {per_core} |"
        )
    lines += [
        "",
        "- per chunk, gateway / vllm-router: "
        f"{_fmt(_ratio(gateway.get('a_us_per_chunk'), router.get('a_us_per_chunk')), 2, 'x')}; per request: "
        f"{_fmt(_ratio(gateway.get('b_us_per_request'), router.get('b_us_per_request')), 2, 'x')}",
        f"- errors in any window: {sum(v['errors'] for path in lengths.values() for v in path.values())}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answer_length", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench"))
    parser.add_argument("--duration", type=float, default=8.0, help="measurement window, seconds")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every length and path")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--from-json", type=Path, help="only write the report again from an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        return _write(json.loads(args.from_json.read_text()), args.output)
    report = report_header()
    windows: dict[str, list[dict]] = {path: [] for path in PATHS}
    with CpuCaps() as caps, Processes() as procs:
        engine, engine_url = start_standin(procs, core=0, tokens=max(ANSWER_TOKENS))
        if error := wait_chat_ready(engine, engine_url, MODEL):
            print(f"the stand-in engine did not start: {error}", file=sys.stderr)
            return 1
        started = start_paths(procs, engine_url, list(PATHS), caps)
        if failed := {path: info["error"] for path, info in started.items() if info["error"]}:
            print(f"not every proxy started: {failed}", file=sys.stderr)
            return 1
        report["commands"] = {path: info["command"] for path, info in started.items()}
        for round_ in range(args.rounds):
            for tokens in ANSWER_TOKENS:
                answer_s = (STANDIN_TIMING["ttft_ms"] + tokens * STANDIN_TIMING["itl_ms"]) / 1000
                for path in PATHS:
                    window = run_window(
                        procs, engine, started[path], STREAMS, args.duration, args.warmup + answer_s, False,
                        ("--body-extra", json.dumps({"max_tokens": tokens}), "--stagger", str(answer_s)),
                    )  # fmt: skip
                    window["max_tokens"] = tokens
                    windows[path].append(window)
                    cpu = window["cpu_s"].get("proxy")
                    print(
                        f"round {round_ + 1}/{args.rounds} {path:>12} {tokens:>4} tokens: "
                        f"{window['chunks_per_s']:7.0f} chunks/s, "
                        f"{window['requests_started'] / window['window_s']:6.1f} requests/s, "
                        f"CPU per chunk {_fmt(cpu and cpu / window['chunks'] * 1e6, 1, ' us')}, "
                        f"errors {window['errors']}",
                        flush=True,
                    )
    report["loadavg_after"] = loadavg()
    report["windows"] = windows
    return _write(report, args.output)


def _write(report: dict, output: Path) -> int:
    windows = report["windows"]
    report["fits"] = {path: fit(ws) for path, ws in windows.items()}
    report["lengths"] = {path: per_length(ws) for path, ws in windows.items()}
    text = render_markdown(report)
    write_report(output, "answer-length", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
