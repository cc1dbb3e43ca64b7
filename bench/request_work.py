"""The gateway's own work per request, counted instead of timed: Python bytecodes executed, by module.

A shared 2-core machine moves a time to first token by tenths of a millisecond from one minute to
the next; the bytecodes a gateway executes for one request do not move at all (the same request,
the same code: the same count, run after run, however busy the machine). This bench starts one
stand-in engine and one gateway worker per commit (`--before REV`, and the working tree or
`--after REV`), sends each the same requests one at a time, and counts with `sys.settrace` opcode
events (a `sitecustomize` of its own, switched on and off by SIGUSR1/SIGUSR2 around the measured
requests, so start-up and warm-up are not counted) every bytecode each gateway runs, by file and
function, less what it runs on a clock with no request (health probes, metric scrapes: counted over
an idle window as long as the measured one). The report gives the count per request, streamed and
whole, with the files that differ most (`--rename old=new` compares a file that moved as one).

Beside the counts, the time to first byte at one stream: the two gateways in turn, request by
request, and the median of the paired differences (after - before), the way a busy machine's
drift cancels best. It is a time and moves with the machine; the count does not.

`--after-tenants` gives the after gateway bench.workers_bench's two tenants (what tenants add to
a request); with `--before-tenants` too, both gateways have them (two versions of the tenants'
path, side by side).

Usage: python -m bench.request_work --before 2734949 [--after REV] [--requests 200] --output DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import paired
from bench.paired import Client
from bench.procs import PYTHON, Processes, commit_of, free_port, gateway_code
from bench.proxy_bench import report_header, write_report
from bench.workers_bench import TENANT_KEY, TENANTS_CONFIG

MODEL = "tiny"
TRACER = """
import collections, json, os, signal, sys
_ops = collections.Counter()
def _tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    frame.f_trace_lines = False
    if event == "opcode":
        code = frame.f_code
        _ops[(code.co_filename, code.co_name)] += 1
    return _tracer
def _on(sig, frame):
    _ops.clear()
    sys.settrace(_tracer)
def _off(sig, frame):
    sys.settrace(None)
    with open(os.environ["REQUEST_WORK_OUT"], "w") as out:
        json.dump([[f, n, v] for (f, n), v in _ops.items()], out)
if os.environ.get("REQUEST_WORK_OUT"):
    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)
"""


def request_bytes(stream: bool, key: str | None = None) -> bytes:
    return paired.request_bytes(MODEL, stream, key)


def counted(path: Path, roots: list[str]) -> Counter[tuple[str, str]]:
    """(file, function) -> opcodes, the file relative to its code root or site-packages."""
    out: Counter[tuple[str, str]] = Counter()
    for file, function, count in json.loads(path.read_text()):
        for root in roots:
            if file.startswith(root):
                file = file[len(root) :]
                break
        out[(file, function)] += count
    return out


def collect(out: Path, roots: list[str]) -> Counter[tuple[str, str]]:
    wait_for_file(out)
    ops = counted(out, roots)
    out.unlink()
    return ops


def by_file(ops: Counter[tuple[str, str]], renames: dict[str, str]) -> Counter[str]:
    files: Counter[str] = Counter()
    for (file, _), count in ops.items():
        files[renames.get(file, file)] += count
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_work", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--after", default="tree", help="a commit, or 'tree' (default): the working tree")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per gateway and mode")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--paired", type=int, default=2000, help="requests per gateway for the paired TTFT")
    parser.add_argument(
        "--rename", action="append", default=[], metavar="OLD=NEW", help="a file that moved (compared as one)"
    )
    parser.add_argument(
        "--after-tenants",
        action="store_true",
        help="the after gateway with bench.workers_bench's two tenants (quotas set, none reached); both sent its key",
    )
    parser.add_argument(
        "--before-tenants",
        action="store_true",
        help="with --after-tenants: the before gateway with the same tenants (compare two versions of their path)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the engine and this client on core 0, both gateways on core 1 (where the scheduler would "
        "otherwise place each process anew every run, and the paired TTFT moves by tens of us with it)",
    )
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.before_tenants and not args.after_tenants:
        parser.error("--before-tenants compares two versions of the tenants' path: give --after-tenants too")
    engine_core, gateway_core = (0, 1) if args.pin else (None, None)
    if args.pin:
        os.sched_setaffinity(0, {0})
    renames = dict(item.split("=", 1) for item in args.rename)

    report = report_header()
    report.update(before=commit_of(args.before), after=commit_of(args.after), requests=args.requests, modes={})
    report["after_tenants"] = args.after_tenants
    report["before_tenants"] = args.before_tenants
    report["pinned"] = args.pin
    key = TENANT_KEY if args.after_tenants else None
    with tempfile.TemporaryDirectory(prefix="request-work-") as tmp, Processes(Path(tmp)) as procs:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(TRACER)
        engine_port = free_port()
        engine = procs.start(
            "standin",
            [PYTHON, "-m", "standin", "--port", str(engine_port), "--model", MODEL, "--ttft-ms", "1", "--itl-ms", "1",
             "--tokens", "8"],
            core=engine_core,
        )  # fmt: skip
        engine_url = f"http://127.0.0.1:{engine_port}"
        gateways = {}
        for side, rev in (("before", args.before), ("after", args.after)):
            workdir = Path(tmp) / side  # (one copy each, even of one commit)
            workdir.mkdir()
            code = gateway_code(workdir, rev)
            port = free_port()
            out = Path(tmp) / f"{side}.json"
            env = {"PYTHONPATH": f"{code}{os.pathsep}{site}", "REQUEST_WORK_OUT": str(out)}
            argv = [PYTHON, "-P", "-m", "server", "serve", "--upstream", f"{MODEL}={engine_url}", "--port", str(port),
                    "--workers", "1"]  # fmt: skip
            if args.after_tenants and (side == "after" or args.before_tenants):
                config = Path(tmp) / "tenants.gateway.yaml"
                tenants = [{**t, "models": [MODEL]} if "models" in t else t for t in TENANTS_CONFIG["tenants"]]
                config.write_text(json.dumps({"tenants": tenants}))  # JSON is YAML
                argv += ["--config", str(config)]
            started = procs.start(f"gateway-{side}", argv, core=gateway_core, env=env)
            gateways[side] = (started, port, out, [str(code) + "/", *site_roots()])
        for side, (started, port, _, _) in gateways.items():
            ready = Client(port) if wait_listening(started, port) else None
            if ready is None:
                raise SystemExit(f"the {side} gateway did not start:\n{started.log_tail()}")
            ready.ask(request_bytes(True, key), True)
            ready.close()
        del engine
        for mode, stream in (("stream", True), ("whole", False)):
            request = request_bytes(stream, key)
            result: dict = {}
            for side, (started, port, out, roots) in gateways.items():
                client = Client(port)
                for _ in range(args.warmup):
                    client.ask(request, stream)
                os.kill(started.pid, signal.SIGUSR1)
                began = time.monotonic()
                for _ in range(args.requests):
                    client.ask(request, stream)
                seconds = time.monotonic() - began
                os.kill(started.pid, signal.SIGUSR2)
                client.close()
                ops = collect(out, roots)
                # What runs on a clock whether requests come or not (health probes, metric scrapes,
                # uvicorn's tick): counted over as long a window with no request, and taken off.
                os.kill(started.pid, signal.SIGUSR1)
                time.sleep(seconds)
                os.kill(started.pid, signal.SIGUSR2)
                idle = collect(out, roots)
                ops.subtract(idle)
                result[side] = {
                    "per_request": sum(ops.values()) / args.requests,
                    "background_per_second": sum(idle.values()) / seconds,
                    "window_s": seconds,
                    "by_file": {f: n / args.requests for f, n in by_file(ops, renames).most_common()},
                    "by_function": {f"{f}:{fn}": n / args.requests for (f, fn), n in ops.most_common(400)},
                }
            result["ratio"] = result["after"]["per_request"] / result["before"]["per_request"]
            result["ttft_paired"] = paired_ttft(gateways, request, stream, args.paired, args.warmup)
            report["modes"][mode] = result
            before, after = result["before"]["per_request"], result["after"]["per_request"]
            print(
                f"{mode}: {before:.0f} -> {after:.0f} opcodes/request "
                f"({result['ratio']:.3f}x); paired TTFT at 1 stream {result['ttft_paired']['median_diff_us']:+.1f} us",
                flush=True,
            )
    report["loadavg_after"] = os.getloadavg()
    write_report(args.output, "request-work", report, render(report))
    return 0


def wait_listening(started, port: int, timeout: float = 120.0) -> bool:
    """The gateway accepts connections (its /health is not asked: a request with the key follows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and started.process.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
        except OSError:
            time.sleep(0.2)
            continue
        return wait_engine_route(port)
    return False


def wait_engine_route(port: int, timeout: float = 60.0) -> bool:
    """The gateway answers /health 200 (its engine is known and healthy)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: bench\r\n\r\n")
            if sock.recv(65536).startswith(b"HTTP/1.1 200"):
                return True
        time.sleep(0.2)
    return False


def site_roots() -> list[str]:
    import sysconfig

    return [sysconfig.get_paths()["purelib"] + "/", sysconfig.get_paths()["stdlib"] + "/"]


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or path.stat().st_size == 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"no opcode counts from the gateway in {timeout:.0f} s ({path})")
        time.sleep(0.1)
    time.sleep(0.2)  # (written in one go by the signal handler; let it close)


def paired_ttft(gateways: dict, request: bytes, stream: bool, n: int, warmup: int) -> dict:
    """bench.paired's, between the two gateways of this bench."""
    ports = {side: port for side, (_, port, _, _) in gateways.items()}
    return paired.paired_ttft(ports, dict.fromkeys(ports, request), stream, n, warmup)


def render(report: dict) -> str:
    lines = [
        f"# The gateway's work per request: {report['before']} -> {report['after']}"
        + (
            " (both with tenants: two, every quota set, none reached)"
            if report.get("before_tenants")
            else " with tenants (two, every quota set, none reached)"
            if report.get("after_tenants")
            else ""
        ),
        "",
        f"{report['date']}, measured at commit {report['commit']}; machine: {report['machine']}; "
        f"load {report['loadavg_before']} before, {report['loadavg_after']} after. "
        f"{report['requests']} requests per gateway and mode, one at a time, after a warm-up; a stand-in "
        "engine (1 ms to the first token, 8 tokens 1 ms apart). Opcodes: every Python bytecode the gateway's "
        "process ran for them (sys.settrace), per request: a count, the same on a quiet or a busy machine. "
        "What the gateway runs on a clock (health probes, scrapes) is counted over as long a window with no "
        "request and taken off. TTFT: the two gateways in turn at one stream (a time: it moves with the machine).",
        "",
        "| mode | opcodes a request, before | after | after / before | paired TTFT, after - before (median; IQR) |",
        "|---|---|---|---|---|",
    ]
    for mode, result in report["modes"].items():
        t = result["ttft_paired"]
        lines.append(
            f"| {mode} | {result['before']['per_request']:.0f} | {result['after']['per_request']:.0f} | "
            f"{result['ratio']:.3f}x | {t['median_diff_us']:+.1f} us ({t['diff_quartiles_us'][0]:+.1f} .. "
            f"{t['diff_quartiles_us'][2]:+.1f}; {t['pairs']} pairs) |"
        )
    for mode, result in report["modes"].items():
        before, after = result["before"]["by_file"], result["after"]["by_file"]
        files = sorted(set(before) | set(after), key=lambda f: -abs(after.get(f, 0) - before.get(f, 0)))[:25]
        lines += ["", f"## {mode}: the files that differ most (opcodes a request)", "", "| file | before | after |",
                  "|---|---|---|"]  # fmt: skip
        lines += [f"| `{f}` | {before.get(f, 0):.1f} | {after.get(f, 0):.1f} |" for f in files]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
