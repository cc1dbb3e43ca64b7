"""What a tenant's quota check costs a request, per counter store, side by side in one run.

The real request-path calls, `await TenantRuntime.enter(...)` (model allow-list, reservation,
the store's decision, the rate-limit headers) and `Ticket.settle(...)`, for one tenant with all
three limits set (requests, tokens, concurrency; nobody over quota), on uvloop, one request at a
time, for:

    none     a tenant without limits (no quota: the baseline)
    memory   this process's counters (`--workers 1`)
    host     the host file of `--workers N` (flock, mmap; tenants.counters_host)
    redis    a redis-server on loopback, started here (one Lua script per admission, one per
             settlement, sent off the answer's path; tenants.counters_redis)
    unix-rtt not a store: one 32-byte round trip over a Unix socket to an asyncio echo server in
             another process, the least a counter service in the supervisor would cost (the
             design not taken, docs/operate/quotas.md)

Each round runs every variant (in a rotated order) for `--requests` requests after a warm-up;
per request the time `enter` took (what the request waits), and per variant the CPU of this
process per request (settlements included: Redis's are awaited at the end of the batch) and of
the redis-server. Figures: the median over rounds of each round's p50 and p99, with the range.

    python -m bench.quota_bench [--rounds 10] [--requests 3000] [--out docs/bench/quota-store/quota.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from server.gateway.settings import Tenant
from server.gateway.tenants.counters import MemoryCounters
from server.gateway.tenants.counters_host import HostCounters, create_host_file
from server.gateway.tenants.counters_redis import RedisCounters
from server.gateway.tenants.directory import TenantDirectory

LIMITS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 10**6}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "two days in Lisbon?"}], "max_tokens": 64}
RAW_LENGTH = 120
ECHO = """
import asyncio, sys, uvloop
async def echo(reader, writer):
    try:
        while data := await reader.readexactly(32):
            writer.write(data)
    except asyncio.IncompleteReadError:
        writer.close()
async def main():
    server = await asyncio.start_unix_server(echo, sys.argv[1])
    print("ready", flush=True)
    await server.serve_forever()
uvloop.run(main())
"""


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Variant:
    def __init__(self, name: str, call: Callable[[], Awaitable[None]], drain: Callable[[], Awaitable[None]]) -> None:
        self.name, self.call, self.drain = name, call, drain
        self.rounds: list[dict[str, float]] = []


def tenant_variant(name: str, limited: bool, store: Any) -> Variant:
    tenant = Tenant(name="t", api_keys=["k"], limits=LIMITS if limited else {})
    directory = TenantDirectory([(tenant, [b"k"])])
    runtime = directory.tenants["t"]
    if runtime.quota is not None:
        runtime.quota.store = store

    async def call() -> None:
        ticket, _ = await runtime.enter("tiny", BODY, RAW_LENGTH)
        if ticket is not None and not ticket.checked:
            raise RuntimeError(f"{name}: the store could not be asked (unchecked): the figures would be wrong")
        if ticket is not None:
            ticket.settle(70)

    async def drain() -> None:
        pending = getattr(store, "_pending", None)
        if pending:
            await asyncio.gather(*pending)

    return Variant(name, call, drain)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
    )  # fmt: skip
    sock_path = str(workdir / "echo.sock")
    echo = subprocess.Popen([sys.executable, "-c", ECHO, sock_path], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        host = HostCounters(create_host_file(str(workdir / "quota.counters"), 1, 2), ["t"], 0)
        redis_store = RedisCounters(url)
        reader, writer = await asyncio.open_unix_connection(sock_path)

        async def round_trip() -> None:
            writer.write(b"x" * 32)
            await reader.readexactly(32)

        async def nothing() -> None:
            pass

        variants = [
            tenant_variant("none", False, None),
            tenant_variant("memory", True, MemoryCounters()),
            tenant_variant("host", True, host),
            tenant_variant("redis", True, redis_store),
            Variant("unix-rtt", round_trip, nothing),
        ]
        for round_no in range(args.rounds):
            order = variants[round_no % len(variants) :] + variants[: round_no % len(variants)]
            for variant in order:
                for _ in range(args.warmup):
                    await variant.call()
                await variant.drain()
                times: list[float] = []
                cpu0, rcpu0 = time.process_time(), cpu_of(redis.pid)
                for _ in range(args.requests):
                    start = time.perf_counter_ns()
                    await variant.call()
                    times.append((time.perf_counter_ns() - start) / 1000)
                await variant.drain()
                cpu, rcpu = time.process_time() - cpu0, cpu_of(redis.pid) - rcpu0
                variant.rounds.append({
                    "p50_us": percentile(times, 0.50),
                    "p99_us": percentile(times, 0.99),
                    "mean_us": statistics.fmean(times),
                    "cpu_us_per_request": cpu / args.requests * 1e6,
                    "redis_cpu_us_per_request": rcpu / args.requests * 1e6,
                })  # fmt: skip
        writer.close()
        await redis_store.aclose()
        host.close()
    finally:
        for process in (redis, echo):
            process.kill()
            process.wait(timeout=30)
    return {variant.name: variant.rounds for variant in variants}


def summary(raw: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, list[float]]]:
    """Per variant and figure: [median over rounds, min, max]."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, rounds in raw.items():
        out[name] = {}
        for figure in rounds[0]:
            values = [r[figure] for r in rounds]
            out[name][figure] = [statistics.median(values), min(values), max(values)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (`make redis`)", file=sys.stderr)
        return 2
    import uvloop

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="quota-bench-") as workdir:
        raw = uvloop.run(run(args, Path(workdir)))
    result = {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "dirty": bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": [load_before, os.getloadavg()],  # before and after: the machine is shared
        "args": vars(args) | {"out": str(args.out) if args.out else None},
        "summary": summary(raw),
        "rounds": raw,
    }
    base = result["summary"]["none"]
    print(f"{'variant':10} {'p50 us':>24} {'p99 us':>24} {'CPU us/req':>24} {'redis CPU':>10}  (median [min..max])")
    for name, figures in result["summary"].items():
        cells = [f"{v[0]:8.2f} [{v[1]:.2f}..{v[2]:.2f}]" for v in (figures[k] for k in ("p50_us", "p99_us"))]
        cpu = figures["cpu_us_per_request"]
        added = f"+{figures['p50_us'][0] - base['p50_us'][0]:.2f}" if name != "none" else ""
        print(f"{name:10} {cells[0]:>24} {cells[1]:>24} {cpu[0]:10.2f} [{cpu[1]:.1f}..{cpu[2]:.1f}] "
              f"{figures['redis_cpu_us_per_request'][0]:8.2f}  p50 {added}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
