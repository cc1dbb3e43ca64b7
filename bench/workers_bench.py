"""`make bench`, second part: the gateway's ceiling with one and two worker processes, beside vllm-router.

One stand-in engine (standin/: 20 ms to the first token, then 10 ms per token, 32 tokens,
34 SSE chunks per answer) and four ways to reach it, all running for the whole run:

- `direct`: no proxy (the baseline of added time to first token);
- `vllm-router`: the Rust router, pinned to core 1;
- `gateway x1`: `python -m server serve --workers 1`, pinned to core 1;
- `gateway x2`: `python -m server serve --workers 2`, worker i pinned to core i;
- `gateway x2 core 1`: two workers, both pinned to core 1 as the router is: the added time to first
  token of the two-worker set-up (connections spread over two processes) without the engine and
  the load generator sharing the workers' cores;
- `gateway x1 tenants` (not run by default: `--paths`): `gateway x1` with two tenants configured
  (keys, an allow-list, every quota set and none reached: TENANTS_CONFIG), the load generator
  sending the first tenant's key: the cost of tenants (key lookup, quota admission and settlement,
  usage counters), side by side with `gateway x1` (`--side-by-side 'gateway x1,gateway x1 tenants'`);
- `gateway x1 tenants no-flow` (not run by default): the same tenants with the flow gate off
  (`flow.enabled: false`): tenants' own cost (issue 31) apart from the gate's (issue 32);
- `gateway x1 capped`, `gateway x2 capped`: the same on core 1 alone, each worker held to a share
  of a core (`--cap`, 0.2 by default) by a CFS quota of its own (a cgroup under the cpu
  controller): the engine and the load generator keep core 0 to themselves, so two workers can
  show what they relay against one where the machine has no two free cores.

For the pinned paths the engine and the load generator (bench/loadgen.py) run on core 0; for
`gateway x2` no core is left for them, so they float over both cores and take their share of the
workers' cores: on this 2-core machine two workers cannot show a clean 2x, and the report says
how much CPU went to the engine and the load generator in the same window. The capped pair is
the scaling measurement: each worker gets the same budget, so the ceiling of two over one says
how much of a second worker's CPU turns into relayed chunks.

Figures per path: added p50 TTFT at 4 streams over direct (interleaved rounds, samples pooled),
CPU per chunk at 64 streams (the proxy's whole process tree, from /proc; interleaved rounds, every
other one in reverse order so that a drift of the machine weighs on every path alike, pooled, and
the gateway/router ratio also round by round), and chunks per second
at 256, 512 and 768 streams: the ceiling is the highest rate reached, with the cores each process
used meanwhile (1.0 = one core busy) and what other processes of a shared machine took: a proxy
below 1.0 core per worker was not what limited the rate. Chunks per proxy CPU-second (the chunks
over the proxy's CPU seconds in that window) is what one busy core relays, whatever the rest of
the machine left it: the figure to size a gateway with.

The ratio of CPU per chunk to vllm-router's is also measured side by side (`--side-by-side`, six
windows by default): the router and one gateway worker, both on core 1, each relaying 64 streams
of its own load generator (both on core 0, with the engine) in the same seconds. A shared
machine's speed drifts by a tenth or more within minutes; windows one after the other carry that
drift into the ratio of each round, windows side by side do not. The same method run on two
gateway workers of the same code (an A/A check: `--before HEAD --side-by-side 'gateway x1,before'`)
gave 0.98-1.02x round by round where its interleaved windows in the same run gave 0.93-1.21x
(docs/bench/workers-aa/workers.md). The added time to first token is measured the same way too:
`direct`, the router, one gateway worker and two on the router's core, each with 4 streams of its
own load generator, in the same seconds (as many windows as `--side-rounds`, each `--low-duration` / 2 long; the samples
pooled), so that the machine's drift between windows does not enter the difference of two p50s
a few tenths of a millisecond apart. At 4 streams each proxy is busy a few percent of the time:
the two on core 1 seldom wait for each other, and if they do, alike. Pooled over ~400 samples a
path, that p50 still moves by a tenth of a millisecond from run to run; the paired TTFT
(`--paired`, bench.paired) settles to a few microseconds: this process, on core 0, sends one
streamed request of one token to each of the two side-by-side paths in turn, the order swapped
every pair, and reports the median of the paired differences.

Usage: python -m bench.workers_bench --output docs/bench [--duration 8] [--paths ...] [--before REV] [--cap 0.2]
       [--side-rounds 6] [--side-by-side vllm-router,gateway x1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median

from bench.loadgen import summarize
from bench.paired import paired_ttft, request_bytes
from bench.procs import (
    PYTHON,
    ROOT,
    Processes,
    Started,
    commit_of,
    free_port,
    gateway_code,
    loadgen_argv,
    start_standin,
    wait_chat_ready,
)
from bench.proxy_bench import MODEL, engine_stats, loadavg, report_header, write_report

ALL_PATHS = (
    "direct", "vllm-router", "gateway x1", "gateway x2", "gateway x2 core 1", "gateway x1 capped", "gateway x2 capped"
)  # fmt: skip
TENANTS = "gateway x1 tenants"
# The same tenants with the flow gate off (`flow.enabled: false`): what tenants cost without issue 32's gate.
TENANTS_NO_FLOW = "gateway x1 tenants no-flow"
WITH_TENANTS = (TENANTS, TENANTS_NO_FLOW)
ONE_CORE = (
    "gateway x1", "gateway x2 core 1", "gateway x1 capped", "gateway x2 capped", TENANTS, TENANTS_NO_FLOW
)  # fmt: skip  # all on core 1
TENANT_KEY = "sk-bench-planner-0123456789abcdef"  # a bench-only key, written in the bench's own config
# Two tenants as an operator would configure them; the limits are far above what the bench sends
# (~10,000 requests a minute at 64 streams), so every request passes the whole quota check and none
# is refused: what is measured is the cost of tenants with nobody over quota.
TENANTS_CONFIG = {
    "tenants": [
        {
            "name": "planner",
            "api_keys": [TENANT_KEY],
            "priority": "interactive",
            "models": [MODEL],
            "limits": {
                "requests_per_minute": 10_000_000,
                "tokens_per_minute": 10_000_000_000,
                "max_concurrent": 100_000,
            },
        },
        {"name": "articles", "api_keys": ["sk-bench-articles-0123456789abcdef"], "priority": "batch"},
    ]
}
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (cpu.cfs_quota_us)
CFS_PERIOD_US = 100_000
DEFAULT_CAP = 0.2  # see docs/bench/workers.md (0.2) and workers-capped-0.15/
LATENCY_AT, CPU_AT = 4, 64
CEILING_AT = (128, 256, 512, 768)  # 128: the throughput a change must keep (issue 29); the rest: the ceiling
BOTH_CORES = "0,1"
CAPPED = ("gateway x1 capped", "gateway x2 capped")


def tenants_config(path: str) -> dict:
    """The gateway config of a path with tenants: TENANTS_CONFIG, the flow gate off for TENANTS_NO_FLOW."""
    return TENANTS_CONFIG | ({"flow": {"enabled": False}} if path == TENANTS_NO_FLOW else {})


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                text = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(text[text.rfind(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


def pin(pid: int, cores: str) -> None:
    """Every thread of `pid` on `cores` (a taskset list)."""
    subprocess.run(["taskset", "-a", "-p", "-c", cores, str(pid)], check=True, capture_output=True)


class CpuCaps:
    """CFS quotas for processes, one cgroup each under the cpu controller, removed on exit."""

    def __init__(self) -> None:
        self.groups: list[Path] = []

    def __enter__(self) -> CpuCaps:
        return self

    def cap(self, pid: int, share: float) -> None:
        """Hold `pid` (every thread) to `share` of one core."""
        group = CPU_CGROUPS / f"gateway-bench-{os.getpid()}-{pid}"
        try:
            group.mkdir()
            self.groups.append(group)
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(share * CFS_PERIOD_US)))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise OSError(f"cannot cap pid {pid} at {share} of a core ({group}: {exc})") from exc

    def __exit__(self, *exc: object) -> None:
        for group in self.groups:  # the processes are gone by now; move any left back, then remove
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (CPU_CGROUPS / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError as error:
                print(f"!! could not remove {group}: {error}", file=sys.stderr)


def start_paths(
    procs: Processes, engine_url: str, paths: list[str], caps: CpuCaps, cap: float = DEFAULT_CAP
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in paths:
        info: dict = {"url": None, "process": None, "command": "", "error": None, "cores": "0"}
        env: dict[str, str] = {}
        out[path] = info
        if path == "direct":
            info.update(url=engine_url, command="(no proxy)")
            continue
        port = free_port()
        if path == "vllm-router":
            argv = [
                str(Path(PYTHON).with_name("vllm-router")), "--port", str(port), "--worker-urls", engine_url,
                "--policy", "round_robin", "--log-level", "warning",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            ]  # fmt: skip
            core: str | None = "1"
        elif (gateway := path.partition(" @"))[0] in ("gateway x2", *ONE_CORE):
            name, _, rev = gateway  # "gateway x1 @abc1234": one worker of commit abc1234's code
            workers = name.split()[1][1:]
            argv = [PYTHON, "-P", "-m", "server", "serve", "--upstream", f"{MODEL}={engine_url}", "--port", str(port),
                    "--workers", workers]  # fmt: skip
            env["PYTHONPATH"] = str(gateway_code(procs.log_dir, rev) if rev else ROOT)
            if name in WITH_TENANTS:
                config = procs.log_dir / f"{name.replace(' ', '-')}.gateway.yaml"
                config.write_text(json.dumps(tenants_config(name)))  # JSON is YAML
                argv += ["--config", str(config)]
                info["loadgen_env"] = {"LOADGEN_API_KEY": TENANT_KEY}
            core = "1" if name in ONE_CORE else BOTH_CORES
        else:
            raise SystemExit(f"unknown path {path!r}; known: {', '.join(ALL_PATHS)}")
        info["command"] = " ".join(argv)
        try:
            started = procs.start(path.replace(" ", "-"), ["taskset", "-c", core, *argv], core=None, env=env)
        except OSError as exc:
            info["error"] = str(exc)
            continue
        info.update(url=f"http://127.0.0.1:{port}", process=started, cores="0" if core == "1" else BOTH_CORES)
    for path, info in out.items():
        if info["process"] is not None:
            if "loadgen_env" in info:
                info["error"] = _wait_ready_with_key(info, timeout=120)
            else:
                info["error"] = wait_chat_ready(info["process"], info["url"], MODEL, timeout=120)
            if info["error"]:
                print(f"!! {path} is not available: {info['error']}", file=sys.stderr)
            elif path in CAPPED:
                pid = info["process"].pid
                workers = _children(pid) if path == "gateway x2 capped" else [pid]
                try:
                    for worker in workers:
                        caps.cap(worker, cap)
                except OSError as exc:
                    info["error"] = str(exc)
                    print(f"!! {path} is not available: {exc}", file=sys.stderr)
                info.update(workers=workers, cap=cap)
            elif path == "gateway x2":
                workers = _children(info["process"].pid)
                for core, worker in enumerate(workers):
                    pin(worker, str(core % 2))
                info["workers"] = workers
    return out


def _wait_ready_with_key(info: dict, timeout: float) -> str | None:
    """`wait_chat_ready` for a gateway with keys: a streamed chat with the path's key answers 200."""
    key = info["loadgen_env"]["LOADGEN_API_KEY"]
    return wait_chat_ready(info["process"], info["url"], MODEL, timeout=timeout, api_key=key)


def _loadgen_env(info: dict) -> dict[str, str] | None:
    """The load generator's environment for a path: the key of a path with keys, else the bench's own."""
    extra = info.get("loadgen_env")
    return {**os.environ, **extra} if extra else None


def _loadgen_argv(
    url: str,
    cores: str,
    concurrency: int,
    duration: float,
    warmup: float,
    cpu: dict[str, int],
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The load generator's command line on `cores` (a taskset list: windows may span both cores)."""
    return ["taskset", "-c", cores, *loadgen_argv(url, concurrency=concurrency, duration=duration, warmup=warmup,
                                                  cpu=cpu, extra=extra)]  # fmt: skip


def run_window(
    procs: Processes,
    engine: Started,
    info: dict,
    concurrency: int,
    duration: float,
    warmup: float,
    samples: bool,
    loadgen_args: tuple[str, ...] = (),
) -> dict:
    """One load-generator window against one path; the engine and the load generator on `info["cores"]`."""
    pin(engine.pid, info["cores"])
    cpu = {"engine": engine.pid, **({"proxy": info["process"].pid} if info["process"] is not None else {})}
    extra = (*(["--samples"] if samples else []), *loadgen_args)
    argv = _loadgen_argv(info["url"], info["cores"], concurrency, duration, warmup, cpu, extra)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + warmup + 120, env=_loadgen_env(info))
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def run_side_by_side(
    engine: Started, infos: dict[str, dict], concurrency: int, duration: float, warmup: float, samples: bool = False
) -> dict:
    """One window in which every path of `infos` (each a process on core 1, or `direct`: none) relays
    `concurrency` streams of its own load generator (on core 0) at the same time: their CPU per chunk
    and time to first token are measured in the same seconds of a shared machine, so a drift of the
    machine moves them alike. `samples`: every TTFT too (for pooling)."""
    pin(engine.pid, "0")
    running: dict[str, subprocess.Popen[str]] = {}
    try:
        for path, info in infos.items():
            cpu = {"proxy": info["process"].pid} if info["process"] is not None else {}
            extra = ("--samples",) if samples else ()
            argv = _loadgen_argv(info["url"], "0", concurrency, duration, warmup, cpu, extra)
            running[path] = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_loadgen_env(info)
            )
        out = {}
        for path, process in running.items():
            stdout, stderr = process.communicate(timeout=duration + warmup + 120)
            if process.returncode != 0:
                raise RuntimeError(f"load generator of {path} failed ({process.returncode}):\n{stderr[-3000:]}")
            out[path] = json.loads(stdout)
        return out
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def side_by_side_rounds(
    engine: Started,
    infos: dict[str, dict],
    rounds: int,
    concurrency: int,
    duration: float,
    warmup: float,
    *,
    show: Callable[[dict], str],
    samples: bool = False,
) -> list[dict[str, dict]]:
    """`rounds` side-by-side windows of every path of `infos`, the order in which their load generators
    start turned by one each round; each window printed as it ends (`show`: a path's figure)."""
    paths = list(infos)
    windows = []
    for round_ in range(rounds):
        turn = round_ % len(paths)
        order = paths[turn:] + paths[:turn]  # which load generator starts first, in turn
        windows.append(run_side_by_side(engine, {p: infos[p] for p in order}, concurrency, duration, warmup, samples))
        print(f"side by side at {concurrency} streams, round {round_}: "
              + ", ".join(f"{p} {show(windows[-1][p])}" for p in paths), flush=True)  # fmt: skip
    return windows


def paired_between(started: dict[str, dict], side: list[str], pairs: int) -> dict:
    """bench.paired's TTFT between the two side-by-side paths (the first is `before`): both on
    core 1, this process as the client on core 0 with the engine; streamed answers of one token
    (the stand-in's 20 ms to it), each path's own key if it has one."""
    ports = {name: int(started[path]["url"].rsplit(":", 1)[1]) for name, path in zip(("before", "after"), side)}
    requests = {
        name: request_bytes(MODEL, True, TENANT_KEY if "loadgen_env" in started[path] else None, max_tokens=1)
        for name, path in zip(("before", "after"), side)
    }
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        return {"paths": side, **paired_ttft(ports, requests, True, pairs, warmup=100)}
    finally:
        os.sched_setaffinity(0, affinity)


def side_by_side_figures(windows: list[dict[str, dict]], paths: list[str]) -> dict:
    """CPU per chunk of each path in each side-by-side window, and the second path's over the first's
    round by round (paired in time) with their median."""
    per_round = [{path: _cpu_per_chunk(window[path]) for path in paths} for window in windows]
    first, second = paths
    ratios_ = [
        None if r[first] is None or r[second] is None or r[first] == 0 else r[second] / r[first] for r in per_round
    ]
    known = [r for r in ratios_ if r is not None]
    return {
        "paths": paths,
        "concurrency": windows[0][first]["concurrency"] if windows else None,
        "cpu_us_per_chunk_rounds": per_round,
        "ratio_rounds": ratios_,
        "ratio_median": median(known) if known else None,
        "errors": sum(window[path]["errors"] for window in windows for path in paths),
    }


def side_by_side_ttft(windows: list[dict[str, dict]], paths: list[str]) -> dict:
    """Added p50 TTFT over `direct` of each of `paths`, all measured in the same windows: the samples
    of every window pooled, and window by window; each later path's minus the first's."""

    def p50(values: list[float]) -> float | None:
        return median(values) if values else None

    pooled = {p: p50([v for w in windows for v in w[p].get("ttft_samples_ms", ())]) for p in ("direct", *paths)}
    added = {p: _minus(pooled[p], pooled["direct"]) for p in paths}
    rounds = [{p: _minus(w[p]["ttft_ms"]["p50"], w["direct"]["ttft_ms"]["p50"]) for p in paths} for w in windows]
    first, others = paths[0], paths[1:]
    return {
        "paths": paths,
        "concurrency": windows[0][first]["concurrency"] if windows else None,
        "p50_ms": pooled,
        "added_ms": added,
        "added_rounds_ms": rounds,
        "minus_first_ms": {p: _minus(added[p], added[first]) for p in others},
        "minus_first_rounds_ms": {p: [_minus(r[p], r[first]) for r in rounds] for p in others},
        "samples": {p: sum(len(w[p].get("ttft_samples_ms", ())) for w in windows) for p in ("direct", *paths)},
        "errors": sum(w[p]["errors"] for w in windows for p in ("direct", *paths)),
    }


def figures(results: dict[str, dict[int, dict]], path: str) -> dict:
    mine, direct = results[path], results.get("direct", {})
    out: dict = {}
    ttft = mine.get(LATENCY_AT, {}).get("ttft_ms", {}).get("p50")
    base = direct.get(LATENCY_AT, {}).get("ttft_ms", {}).get("p50")
    out["added_ttft_ms_at_4"] = None if ttft is None or base is None or path == "direct" else ttft - base
    at = mine.get(CPU_AT)
    out["cpu_us_per_chunk_at_64"] = _cpu_per_chunk(at) if at else None
    out["cpu_us_per_chunk_rounds"] = at.get("rounds_cpu_us_per_chunk", []) if at else []
    ceiling = max((mine[c] for c in CEILING_AT if c in mine), key=lambda r: r["chunks_per_s"], default=None)
    if ceiling is not None:
        out["ceiling_chunks_per_s"] = ceiling["chunks_per_s"]
        out["ceiling_at_streams"] = ceiling["concurrency"]
        out["ceiling_errors"] = ceiling["errors"]
        window = ceiling["window_s"]
        out["ceiling_cores_used"] = {name: seconds / window for name, seconds in ceiling["cpu_s"].items()}
        out["ceiling_other_cores"] = ceiling.get("foreign_cpu_s", 0.0) / window
        proxy_cpu = ceiling["cpu_s"].get("proxy")
        # What one core of the proxy relays when it is busy: independent of how much of its cores
        # the rest of a shared machine left it (the operator's sizing figure).
        out["chunks_per_proxy_core_s"] = ceiling["chunks"] / proxy_cpu if proxy_cpu else None
    return out


def _cpu_per_chunk(window: dict) -> float | None:
    proxy = window["cpu_s"].get("proxy")
    return proxy / window["chunks"] * 1e6 if proxy is not None and window["chunks"] else None


def ratios(fig: dict[str, dict]) -> dict:
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    one, two, router = fig.get("gateway x1", {}), fig.get("gateway x2", {}), fig.get("vllm-router", {})
    one_capped, two_capped = fig.get("gateway x1 capped", {}), fig.get("gateway x2 capped", {})
    before = next((f for path, f in fig.items() if path.startswith("gateway x1 @")), {})
    return {
        "cpu_per_chunk_before_vs_router": ratio(
            before.get("cpu_us_per_chunk_at_64"), router.get("cpu_us_per_chunk_at_64")
        ),
        "cpu_per_chunk_x1_vs_before": ratio(one.get("cpu_us_per_chunk_at_64"), before.get("cpu_us_per_chunk_at_64")),
        "cpu_per_chunk_x1_vs_router": ratio(one.get("cpu_us_per_chunk_at_64"), router.get("cpu_us_per_chunk_at_64")),
        # Round by round (the two measured within a minute of each other): how much of the spread is the machine's.
        "cpu_per_chunk_x1_vs_router_rounds": [
            ratio(a, b)
            for a, b in zip(one.get("cpu_us_per_chunk_rounds", []), router.get("cpu_us_per_chunk_rounds", []))
        ],
        "cpu_per_chunk_x2_vs_x1": ratio(two.get("cpu_us_per_chunk_at_64"), one.get("cpu_us_per_chunk_at_64")),
        "ceiling_x2_vs_x1": ratio(two.get("ceiling_chunks_per_s"), one.get("ceiling_chunks_per_s")),
        "ceiling_x2_vs_x1_capped": ratio(
            two_capped.get("ceiling_chunks_per_s"), one_capped.get("ceiling_chunks_per_s")
        ),
        "per_core_x2_vs_x1_capped": ratio(
            two_capped.get("chunks_per_proxy_core_s"), one_capped.get("chunks_per_proxy_core_s")
        ),
        # Chunks per proxy CPU-second: what each worker's core relays, two workers against one.
        "per_core_x2_vs_x1": ratio(two.get("chunks_per_proxy_core_s"), one.get("chunks_per_proxy_core_s")),
        "added_ttft_x1_minus_router_ms": _minus(one.get("added_ttft_ms_at_4"), router.get("added_ttft_ms_at_4")),
        "added_ttft_x2_minus_router_ms": _minus(two.get("added_ttft_ms_at_4"), router.get("added_ttft_ms_at_4")),
        "added_ttft_x2_core1_minus_router_ms": _minus(
            fig.get("gateway x2 core 1", {}).get("added_ttft_ms_at_4"), router.get("added_ttft_ms_at_4")
        ),
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{suffix}" if isinstance(value, float) else f"{value}{suffix}"


def _rounds_line(fig: dict[str, dict]) -> list[str]:
    rounds = [
        f"{path} {', '.join(_fmt(v, 1) for v in f['cpu_us_per_chunk_rounds'])} us"
        for path, f in fig.items()
        if f.get("cpu_us_per_chunk_rounds")
    ]
    return [f"- CPU per chunk at 64 streams in each interleaved round: {'; '.join(rounds)}"] if rounds else []


def _by_round(values: list[float | None] | None) -> str:
    """`; round by round 1.21x, 1.30x, ... (median 1.25x)` for per-round ratios, or nothing."""
    values = values or []
    known = [v for v in values if v is not None]
    if len(known) < 2:
        return ""
    return f"; round by round {', '.join(_fmt(v, 2, 'x') for v in values)} (median {_fmt(median(known), 2, 'x')})"


def _side_by_side_lines(side: dict | None) -> list[str]:
    if not side or not side.get("cpu_us_per_chunk_rounds"):
        return []
    first, second = side["paths"]
    each = "; ".join(
        ", ".join(f"{path} {_fmt(values[path], 1)}" for path in (first, second))
        for values in side["cpu_us_per_chunk_rounds"]
    )
    return [
        f"- CPU per chunk side by side ({first} and {second} relaying at once, {side['concurrency']} streams "
        f"each), {second} / {first}: median {_fmt(side['ratio_median'], 2, 'x')}"
        + (" (goal <= 1.25x)" if (first, second) == ("vllm-router", "gateway x1") else "")
        + (" (goal <= 1.03x)" if first == "gateway x1" and second in WITH_TENANTS else "")
        + "; round by round "
        f"{', '.join(_fmt(v, 2, 'x') for v in side['ratio_rounds'])}; us per chunk in each: {each}; "
        f"errors {side['errors']}",
    ]


def _side_ttft_lines(side: dict | None) -> list[str]:
    if not side or not side.get("added_rounds_ms"):
        return []
    first, *others = side["paths"]
    added = ", ".join(f"{p} {_fmt(side['added_ms'][p], 2, ' ms')}" for p in side["paths"])
    minus = "; ".join(
        f"{p} minus {first}: {_fmt(side['minus_first_ms'][p], 2, ' ms')} (window by window "
        f"{', '.join(_fmt(v, 2) for v in side['minus_first_rounds_ms'][p])} ms)"
        for p in others
    )
    goal = "+0.05" if set(WITH_TENANTS) & set(others) else "+0.3"
    return [
        f"- added p50 TTFT side by side (direct, {', '.join(side['paths'])} each with {side['concurrency']} streams "
        f"of its own load generator, at once; {len(side['added_rounds_ms'])} windows, samples pooled): {added} "
        f"over direct; {minus} (goal <= {goal} ms); "
        f"samples {', '.join(f'{p} {n}' for p, n in side['samples'].items())}; "
        f"errors {side['errors']}"
    ]


def _paired_lines(paired: dict | None) -> list[str]:
    if not paired:
        return []
    first, second = paired["paths"]
    low, _, high = paired["diff_quartiles_us"]
    goal = (
        "+50 us" if set(WITH_TENANTS) & set(paired["paths"]) or any("@" in p for p in paired["paths"]) else None
    )  # issues 31, 29
    return [
        f"- paired TTFT (bench.paired: one client on core 0, {first} and {second} in turn, one streamed request "
        f"at a time, {paired['pairs']} pairs): {second} minus {first} {paired['median_diff_us']:+.1f} us "
        f"(quartiles of the differences {low:+.1f} .. {high:+.1f} us)" + (f" (goal <= {goal})" if goal else "")
    ]


def _errors(results: dict[str, dict[int, dict]]) -> str:
    found = []
    for path, phases in results.items():
        for concurrency, res in sorted(phases.items(), key=lambda item: int(item[0])):
            if res["errors"]:
                kinds = ", ".join(f"{kind} x{count}" for kind, count in res.get("error_kinds", {}).items())
                found.append(f"{path} at {concurrency} streams: {res['errors']} ({kinds})")
    return "; ".join(found) or "none"


def render_markdown(report: dict) -> str:
    lines = [
        "# The gateway on one and on two cores: workers beside vllm-router",
        "",
        f"- date: {report['date']}; commit: {report['commit']}",
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, kernel "
        f"{report['machine']['kernel']}, Python {report['machine']['python']}, vllm-router "
        f"{report['machine']['vllm_router']}",
        f"- load average before / after: {report['loadavg_before']} / {report['loadavg_after']} (a shared machine)",
        "",
        "## Method",
        "",
        (__doc__ or "").split("\n\n", 1)[1].rsplit("\n\nUsage:", 1)[0],
        "",
        "## Figures",
        "",
        "| path | added p50 TTFT at 4 | CPU per chunk at 64 | ceiling chunks/s (at streams) | "
        "cores used at the ceiling: proxy / engine / loadgen / other processes | chunks per proxy CPU-second "
        "at the ceiling | errors at the ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for path, fig in report["figures"].items():
        used = fig.get("ceiling_cores_used", {})
        lines.append(
            f"| {path} | {_fmt(fig.get('added_ttft_ms_at_4'), 2, ' ms')} | "
            f"{_fmt(fig.get('cpu_us_per_chunk_at_64'), 1, ' us')} | "
            f"{_fmt(fig.get('ceiling_chunks_per_s'), 0)} ({_fmt(fig.get('ceiling_at_streams'))}) | "
            f"{_fmt(used.get('proxy'), 2)} / {_fmt(used.get('engine'), 2)} / {_fmt(used.get('loadgen'), 2)} / "
            f"{_fmt(fig.get('ceiling_other_cores'), 2)} | {_fmt(fig.get('chunks_per_proxy_core_s'), 0)} | "
            f"{_fmt(fig.get('ceiling_errors'))} |"
        )
    r = report["ratios"]
    lines += [
        "",
        *_side_by_side_lines(report.get("side_by_side")),
        *_side_ttft_lines(report.get("side_by_side_ttft")),
        *_paired_lines(report.get("paired_ttft")),
        f"- CPU per chunk, gateway (1 worker) / vllm-router, in interleaved windows: "
        f"{_fmt(r['cpu_per_chunk_x1_vs_router'], 2, 'x')} "
        "(goal <= 1.25x)" + _by_round(r.get("cpu_per_chunk_x1_vs_router_rounds")),
        *_rounds_line(report["figures"]),
        *(
            [
                f"- CPU per chunk, the gateway at an earlier commit (1 worker) / vllm-router: "
                f"{_fmt(r['cpu_per_chunk_before_vs_router'], 2, 'x')}; now / then: "
                f"{_fmt(r['cpu_per_chunk_x1_vs_before'], 2, 'x')}"
            ]
            if r.get("cpu_per_chunk_before_vs_router") is not None
            else []
        ),
        f"- added p50 TTFT at 4 streams, gateway minus vllm-router: 1 worker "
        f"{_fmt(r['added_ttft_x1_minus_router_ms'], 2, ' ms')}, 2 workers "
        f"{_fmt(r['added_ttft_x2_minus_router_ms'], 2, ' ms')}, 2 workers on the router's core "
        f"{_fmt(r.get('added_ttft_x2_core1_minus_router_ms'), 2, ' ms')} (goal <= +0.3 ms)",
        f"- ceiling, 2 workers / 1 worker: {_fmt(r['ceiling_x2_vs_x1'], 2, 'x')} (goal >= 1.8x where the machine "
        "allows it; here the engine and the load generator share the two cores with the workers)",
        f"- ceiling with each worker held to {report.get('cap', DEFAULT_CAP)} of a core (CFS quota; engine and "
        f"load generator alone on core 0), 2 workers / 1 worker: {_fmt(r.get('ceiling_x2_vs_x1_capped'), 2, 'x')} "
        f"(goal >= 1.8x); chunks per proxy CPU-second, 2 / 1: {_fmt(r.get('per_core_x2_vs_x1_capped'), 2, 'x')}",
        f"- chunks per proxy CPU-second at the ceiling, 2 workers / 1 worker: "
        f"{_fmt(r.get('per_core_x2_vs_x1'), 2, 'x')} (near 1.0: each worker's core relays what one worker's core "
        "does, so N free cores relay N times as much)",
        f"- CPU per chunk at 64 streams, 2 workers / 1 worker: {_fmt(r['cpu_per_chunk_x2_vs_x1'], 2, 'x')}",
        f"- errors in any window: {_errors(report['results'])}",
        "",
        "| path | streams | chunks/s | TTFT p50 / p90 / p99 ms | errors | CPU s proxy / engine / loadgen "
        "| other processes' CPU s | window s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path, phases in report["results"].items():
        for concurrency, res in sorted(phases.items(), key=lambda item: int(item[0])):
            ttft, cpu = res["ttft_ms"], res["cpu_s"]
            lines.append(
                f"| {path} | {concurrency} | {res['chunks_per_s']:.0f} | {_fmt(ttft['p50'], 2)} / "
                f"{_fmt(ttft['p90'], 2)} / {_fmt(ttft['p99'], 2)} | {res['errors']} | {_fmt(cpu.get('proxy'), 2)} / "
                f"{_fmt(cpu.get('engine'), 2)} / {_fmt(cpu.get('loadgen'), 2)} | "
                f"{_fmt(res.get('foreign_cpu_s'), 2)} | {res['window_s']:.1f} |"
            )
    if report["unavailable"]:
        missing = report["unavailable"].items()
        lines += ["", "Not measured: " + "; ".join(f"{p}: {e.splitlines()[0]}" for p, e in missing)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workers_bench", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/bench"))
    parser.add_argument("--duration", type=float, default=8.0, help="measurement window, seconds")
    parser.add_argument("--low-duration", type=float, default=12.0, help="window at 4 streams, seconds (pooled)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved windows at 4 streams")
    parser.add_argument("--cpu-rounds", type=int, default=4, help="interleaved windows at 64 streams (CPU per chunk)")
    parser.add_argument("--side-rounds", type=int, default=6, help="side-by-side windows at 64 streams (0: none)")
    parser.add_argument(
        "--paired",
        type=int,
        default=1000,
        help="pairs of the paired TTFT between the two side-by-side paths (bench.paired; 0: none)",
    )
    parser.add_argument(
        "--side-by-side",
        default="vllm-router,gateway x1",
        metavar="A,B",
        help="the two paths of the side-by-side windows, reported as B / A ('before': the --before path; "
        "'gateway x1,before' with --before HEAD is an A/A check of the method)",
    )
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--paths", default=",".join(ALL_PATHS))
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also run one worker of the gateway at commit REV (path `gateway x1 @REV`), for a before/after in one run",
    )
    parser.add_argument(
        "--cap",
        type=float,
        default=DEFAULT_CAP,
        help="share of a core each worker of the capped paths may use (CFS quota)",
    )
    parser.add_argument("--from-json", type=Path, help="only write the report again from an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        report["results"] = {p: {int(c): r for c, r in ph.items()} for p, ph in report["results"].items()}
        return _write(report, args.output)
    paths = [p for p in args.paths.split(",") if p]
    if "direct" not in paths:
        paths.insert(0, "direct")
    before = f"gateway x1 @{commit_of(args.before)}" if args.before else None
    if before:
        paths.append(before)
    side = [before if name == "before" else name for name in args.side_by_side.split(",")]
    if args.side_rounds and (len(side) != 2 or any(p not in paths or p in ("direct", "gateway x2") for p in side)):
        parser.error(f"--side-by-side needs two of the measured one-core paths, not {args.side_by_side!r}")
    report: dict = {
        **report_header(),
        "cap": args.cap,
    }
    with CpuCaps() as caps, Processes() as procs:
        engine, engine_url = start_standin(procs, core=0)
        if error := wait_chat_ready(engine, engine_url, MODEL):
            print(f"the stand-in engine did not start: {error}", file=sys.stderr)
            return 1
        started = start_paths(procs, engine_url, paths, caps, args.cap)
        report["commands"] = {path: info["command"] for path, info in started.items()}
        report["unavailable"] = {path: info["error"] for path, info in started.items() if info["error"]}
        live = [path for path in paths if not started[path]["error"]]
        results: dict[str, dict[int, dict]] = {path: {} for path in live}
        plan = [(LATENCY_AT, live), (CPU_AT, [p for p in live if p != "direct"])]
        plan += [(c, [p for p in live if p != "direct"]) for c in CEILING_AT]
        for concurrency, measured in plan:
            # Interleaved rounds at 4 streams (latency) and at 64 (CPU per chunk), every other one in
            # reverse order (ABC CBA ...): a drift of the machine over the run then weighs on every
            # path alike, whatever its place in a round.
            rounds = {LATENCY_AT: args.rounds, CPU_AT: args.cpu_rounds}.get(concurrency, 1)
            duration = args.low_duration / rounds if concurrency == LATENCY_AT else args.duration
            windows: dict[str, list[dict]] = {path: [] for path in measured}
            for round_ in range(rounds):
                for path in measured if round_ % 2 == 0 else measured[::-1]:
                    before = engine_stats(engine_url)["started"]
                    window = run_window(procs, engine, started[path], concurrency, duration, args.warmup, rounds > 1)
                    window["engine_started"] = engine_stats(engine_url)["started"] - before
                    windows[path].append(window)
            for path in measured:
                result = summarize(windows[path])
                result.pop("ttft_samples_ms", None)
                if rounds > 1:
                    result["rounds_cpu_us_per_chunk"] = [_cpu_per_chunk(w) for w in windows[path]]
                results[path][concurrency] = result
                print(
                    f"{path:>12} {concurrency:>4} streams: {result['chunks_per_s']:7.0f} chunks/s, TTFT p50 "
                    f"{_fmt(result['ttft_ms']['p50'], 2)} ms, errors {result['errors']}, CPU {result['cpu_s']}",
                    flush=True,
                )
        if args.side_rounds and all(path in live for path in side):
            side_windows = side_by_side_rounds(
                engine, {p: started[p] for p in side}, args.side_rounds, CPU_AT, args.duration, args.warmup,
                show=lambda w: f"{_fmt(_cpu_per_chunk(w), 1)} us/chunk",
            )  # fmt: skip
            report["side_by_side"] = side_by_side_figures(side_windows, side)
            if "direct" in live:
                # Two workers on the router's core too, when measured: their first chunks beside the others'.
                compared = [*side, *(p for p in ("gateway x2 core 1",) if p in live and p not in side)]
                ttft_windows = side_by_side_rounds(
                    engine, {p: started[p] for p in ("direct", *compared)}, args.side_rounds, LATENCY_AT,
                    args.low_duration / 2, args.warmup,
                    samples=True, show=lambda w: f"TTFT {_fmt(w['ttft_ms']['p50'], 2)} ms",
                )  # fmt: skip
                report["side_by_side_ttft"] = side_by_side_ttft(ttft_windows, compared)
            if args.paired:
                report["paired_ttft"] = paired_between(started, side, args.paired)
                print(f"paired TTFT, {side[1]} minus {side[0]}: {report['paired_ttft']['median_diff_us']:+.1f} us")
    report["loadavg_after"] = loadavg()
    report["results"] = results
    return _write(report, args.output)


def _write(report: dict, output: Path) -> int:
    report["figures"] = {path: figures(report["results"], path) for path in report["results"]}
    report["ratios"] = ratios(report["figures"])
    text = render_markdown(report)
    write_report(output, "workers", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
