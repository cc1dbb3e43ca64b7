"""A lean closed-loop load generator for streaming chat completions, run as its own process.

Each of `concurrency` workers keeps one keep-alive HTTP/1.1 connection and sends the same streaming
request again as soon as the previous answer ended. The client is `http1` (asyncio + httptools,
on uvloop when installed), the client the gateway and the load tester use, with a sink that only
counts SSE events, so that one core can drive hundreds of streams and the proxy under test, not
the client, is what gets measured.

What it records inside the measurement window (after a warm-up):
- time to first token: from writing the request to the arrival of the first content event (for a
  chat stream the second event; the first only carries the role);
- chunks: SSE events received (`data: [DONE]` excluded), requests completed;
- errors: non-200 answers, connections that break, streams without `data: [DONE]`, error events,
  answers slower than the per-request timeout;
- CPU seconds of the process trees named with `--cpu NAME=PID` (read from /proc at the window edges).

Usage: python -m bench.loadgen --url http://127.0.0.1:8000 --model standin --concurrency 64
       --duration 8 [--warmup 2] [--cpu proxy=1234] ; prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from urllib.parse import urlsplit

import http1
from bench.proctree import cores_busy_seconds, tree_cpu_split

EVENT_END = b"\n\n"
DONE = b"data: [DONE]"
ERROR_EVENT = b'data: {"error"'


class _Response:
    """The outcome of one request on a connection."""

    __slots__ = ("status", "events", "first_token_at", "done", "error", "body_error")

    def __init__(self) -> None:
        self.status = 0
        self.events = 0
        self.first_token_at = 0.0
        self.done = False
        self.error = ""
        self.body_error = False


class _Connection(http1.Connection):
    """One HTTP/1.1 keep-alive connection running one request at a time; counts SSE events.

    http1 does the framing; the body is spliced into `_body` chunk by chunk as httptools parses it
    (no task step per chunk), and each read is stamped on arrival (the first token's time).
    """

    def __init__(self, stats: _Counters, first_token_event: int):
        super().__init__(clock=time.perf_counter)
        self.stats = stats
        self.first_token_event = first_token_event
        self.response: _Response | None = None
        self.tail = b""  # the last bytes of the body seen, to count event ends split across reads

    async def request(self, payload: bytes) -> _Response:
        """Send `payload` (a whole request) and read its answer; a broken connection is its `error`."""
        response = self.response = _Response()
        self.tail = b""
        try:
            self.send(payload)
            await self.read_head()
            response.status = self.status
            await self.splice(self._body)
        except http1.ProtocolError:
            response.error = "connection closed mid-response"
        finally:
            self.response = None
            if not self.reusable():
                self.close()
        return response

    def _body(self, piece: bytes) -> None:
        response = self.response
        tail = self.tail
        events = piece.count(EVENT_END) + (tail[-1:] == b"\n" and piece[:1] == b"\n")
        joined = tail + piece
        self.tail = joined[-16:]  # long enough to find `data: [DONE]` split across two reads
        if not events or response is None or response.status != 200:
            return
        before = response.events
        response.events = before + events
        if before < self.first_token_event <= response.events:
            response.first_token_at = self.arrived
        if not response.done and DONE in joined:
            response.done = True
            response.events -= 1
        if ERROR_EVENT in joined:
            response.body_error = True
        self.stats.chunks += response.events - before


class _Counters:
    __slots__ = ("chunks", "completed", "started", "recording", "ttfts", "errors")

    def __init__(self) -> None:
        self.chunks = 0
        self.completed = 0
        self.started = 0  # requests sent in the window (`completed`: sent and answered in it)
        self.recording = False
        self.ttfts: list[float] = []
        self.errors: dict[str, int] = {}


def build_request(host: str, port: int, path: str, body: dict) -> bytes:
    """The whole streaming request (head and JSON body), built once and sent again and again."""
    data = json.dumps(body).encode()
    _, start = http1.request_start(f"http://{host}:{port}{path}")
    headers = [("content-type", "application/json"), ("accept", "text/event-stream")]
    if key := os.environ.get("LOADGEN_API_KEY"):  # a gateway with keys (tenants): sent as a bearer token
        headers.append(("authorization", f"Bearer {key}"))
    return http1.request_head(start, headers, len(data)) + data


async def _worker(
    host, port, payload, counters, first_token_event, stop: asyncio.Event, timeout: float, delay: float = 0.0
):
    loop = asyncio.get_running_loop()
    if delay:
        with contextlib.suppress(TimeoutError):  # (the run may end first)
            await asyncio.wait_for(stop.wait(), delay)
    connection: _Connection | None = None
    while not stop.is_set():
        try:
            if connection is None or connection.closed:
                _, connection = await asyncio.wait_for(
                    loop.create_connection(lambda: _Connection(counters, first_token_event), host, port), timeout
                )
            started = time.perf_counter()
            recording = counters.recording
            counters.started += recording
            response = await asyncio.wait_for(connection.request(payload), timeout)
        except (TimeoutError, OSError) as exc:
            if counters.recording:
                kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else f"connect: {type(exc).__name__}"
                counters.errors[kind] = counters.errors.get(kind, 0) + 1
            if connection is not None and connection.transport is not None:
                connection.transport.close()
            connection = None
            await asyncio.sleep(0.05)
            continue
        if not (recording and counters.recording):
            continue
        error = response.error
        if not error and response.status != 200:
            error = f"status {response.status}"
        elif not error and response.body_error:
            error = "error event in stream"
        elif not error and not response.done:
            error = "stream ended without [DONE]"
        if error:
            counters.errors[error] = counters.errors.get(error, 0) + 1
            continue
        counters.completed += 1
        if response.first_token_at:
            counters.ttfts.append((response.first_token_at - started) * 1000)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_load(
    url: str,
    *,
    model: str,
    concurrency: int,
    duration: float,
    warmup: float,
    cpu_pids: dict[str, int],
    timeout: float = 60.0,
    body_extra: dict | None = None,
    samples: bool = False,
    stagger: float = 0.0,
) -> dict:
    """Drive `concurrency` streams at `url` for warmup + duration seconds; the window's figures."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the benchmark"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **(body_extra or {}),
    }
    payload = build_request(host, port, "/v1/chat/completions", body)
    counters = _Counters()
    stop = asyncio.Event()
    workers = [
        asyncio.create_task(_worker(host, port, payload, counters, 2, stop, timeout, stagger * i / concurrency))
        for i in range(concurrency)
    ]
    await asyncio.sleep(warmup)
    split_before = {name: tree_cpu_split(pid) for name, pid in cpu_pids.items()}
    own_before = _own_cpu()
    cores_before = cores_busy_seconds()
    chunks_before = counters.chunks
    started = time.perf_counter()
    counters.recording = True
    await asyncio.sleep(duration)
    counters.recording = False
    elapsed = time.perf_counter() - started
    chunks = counters.chunks - chunks_before
    split = {name: tree_cpu_split(pid) for name, pid in cpu_pids.items()}
    system = {name: split[name][1] - split_before[name][1] for name in cpu_pids}
    cpu = {name: sum(split[name]) - sum(split_before[name]) for name in cpu_pids}
    cpu["loadgen"] = _own_cpu() - own_before
    cores = {name: busy - cores_before.get(name, 0.0) for name, busy in cores_busy_seconds().items()}
    # CPU time of processes other than the measured ones (a shared machine's noise), both cores
    foreign = sum(cores.values()) - sum(cpu.values())
    stop.set()
    _, pending = await asyncio.wait(workers, timeout=min(timeout, 15.0))  # let answers in flight end
    for task in pending:
        task.cancel()
    ttfts = counters.ttfts
    return {
        "url": url,
        "concurrency": concurrency,
        "window_s": round(elapsed, 3),
        "requests": counters.completed,
        "requests_started": counters.started,
        "chunks": chunks,
        "requests_per_s": counters.completed / elapsed,
        "chunks_per_s": chunks / elapsed,
        "errors": sum(counters.errors.values()),
        "error_kinds": counters.errors,
        "ttft_ms": _ttft_summary(ttfts),
        "cpu_s": cpu,
        "system_cpu_s": system,  # the kernel's part of cpu_s (system calls, the network stack)
        "cores_busy_s": cores,
        "foreign_cpu_s": foreign,
        **({"ttft_samples_ms": ttfts} if samples else {}),
    }


def summarize(results: list[dict]) -> dict:
    """Several windows of one path and concurrency as one (the TTFT figures need `samples`)."""
    if len(results) == 1:
        return results[0]
    window = sum(result["window_s"] for result in results)
    ttfts = [value for result in results for value in result.get("ttft_samples_ms", ())]
    errors: dict[str, int] = {}
    cpu: dict[str, float] = {}
    for result in results:
        for kind, count in result["error_kinds"].items():
            errors[kind] = errors.get(kind, 0) + count
        for name, seconds in result["cpu_s"].items():
            cpu[name] = cpu.get(name, 0.0) + seconds
    requests = sum(result["requests"] for result in results)
    chunks = sum(result["chunks"] for result in results)
    foreign = sum(result.get("foreign_cpu_s", 0.0) for result in results)
    return {
        "url": results[0]["url"],
        "concurrency": results[0]["concurrency"],
        "window_s": round(window, 3),
        "windows": len(results),
        "requests": requests,
        "chunks": chunks,
        "requests_per_s": requests / window,
        "chunks_per_s": chunks / window,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "ttft_ms": _ttft_summary(ttfts),
        "cpu_s": cpu,
        "foreign_cpu_s": foreign,
    }


def _ttft_summary(ttfts: list[float]) -> dict:
    return {
        "p50": statistics.median(ttfts) if ttfts else None,
        "p90": _percentile(ttfts, 0.9),
        "p99": _percentile(ttfts, 0.99),
        "mean": statistics.fmean(ttfts) if ttfts else None,
        "n": len(ttfts),
    }


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="standin")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--cpu", action="append", default=[], help="NAME=PID: measure that process tree's CPU")
    parser.add_argument("--body-extra", default="{}", help="JSON merged into the request body")
    parser.add_argument("--samples", action="store_true", help="also print every TTFT (ttft_samples_ms)")
    parser.add_argument(
        "--stagger", type=float, default=0.0,
        help="start the streams evenly over this many seconds (of the warm-up): answers as long as this "
        "then do not start and end in waves",
    )  # fmt: skip
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    cpu_pids = {name: int(pid) for name, _, pid in (item.partition("=") for item in args.cpu)}
    _use_uvloop()
    result = asyncio.run(
        run_load(
            args.url, model=args.model, concurrency=args.concurrency, duration=args.duration,
            warmup=args.warmup, cpu_pids=cpu_pids, timeout=args.timeout, body_extra=json.loads(args.body_extra),
            samples=args.samples, stagger=args.stagger,
        )
    )  # fmt: skip
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
