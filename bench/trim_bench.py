"""What history trimming costs: gateway time to first token with trimming on vs off, 200 messages.

The trimming issue's benchmark. Two gateways run side by side on core 1 in front of one stand-in
engine (core 0): the same settings except `trimming.mode` (`auto` vs `off`) for the model. One
client on core 0 sends, alternately to each gateway, a streaming chat request whose history has
200 messages of which only the newest is new (as in a chat that grows by one message per turn), and
records the time to first token. The figure is the difference of the medians; the stand-in's
tokenize counter shows how many /tokenize calls trimming made per request.

Runs as part of `make bench` (bench/proxy_bench.py), or alone:
python -m bench.trim_bench [--requests 150] [--output docs/bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.loadgen import _Connection, _Counters, _use_uvloop, build_request
from bench.procs import PYTHON, Processes, Started, free_port, wait_chat_ready

MODEL = "standin"
HISTORY_MESSAGES = 200
PROXY_CORE, CLIENT_CORE = 1, 0
GOAL_MS = 2.0


def history(n_messages: int = HISTORY_MESSAGES - 1) -> list[dict]:
    """A system prompt and alternating user/assistant turns of about 20 words each."""
    messages = [{"role": "system", "content": "You are a helpful travel assistant. Answer briefly and plan ahead."}]
    for i in range(n_messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({
            "role": role,
            "content": f"Turn {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(20)),
        })  # fmt: skip
    return messages


def gateway_config(engine_url: str, mode: str, directory: Path) -> Path:
    path = directory / f"gateway-trim-{mode}.yaml"
    config = {"models": [{"name": MODEL, "urls": [engine_url], "trimming": {"mode": mode}}]}
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


async def _ttft(connection: _Connection, payload: bytes) -> float | None:
    started = time.perf_counter()
    response = await asyncio.wait_for(connection.request(payload), 60)
    if response.status != 200 or not response.done or not response.first_token_at:
        return None
    return (response.first_token_at - started) * 1000


async def _measure(urls: dict[str, str], engine_url: str, requests: int, warmup: int) -> dict:
    loop = asyncio.get_running_loop()
    base = history()
    connections = {}
    for mode, url in urls.items():
        parts = urlsplit(url)
        _, connections[mode] = await loop.create_connection(
            lambda: _Connection(_Counters(), 2), parts.hostname, parts.port
        )
    samples: dict[str, list[float]] = {mode: [] for mode in urls}
    failures = {mode: 0 for mode in urls}
    first: dict[str, float | None] = {}
    tokenize: dict[str, int] = {mode: 0 for mode in urls}
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        for i in range(warmup + requests):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for mode in order:
                messages = [*base, {"role": "user", "content": f"New question {i} for {mode}: what next?"}]
                body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 1}
                parts = urlsplit(urls[mode])
                payload = build_request(parts.hostname, parts.port, "/v1/chat/completions", body)
                before = (await client.get(f"{engine_url}/_standin/stats")).json()["tokenize_calls"]
                if connections[mode].closed:
                    _, connections[mode] = await loop.create_connection(
                        lambda: _Connection(_Counters(), 2), parts.hostname, parts.port
                    )
                ttft = await _ttft(connections[mode], payload)
                after = (await client.get(f"{engine_url}/_standin/stats")).json()["tokenize_calls"]
                if i == 0:
                    first[mode] = ttft
                if i < warmup:
                    continue
                tokenize[mode] += after - before
                if ttft is None:
                    failures[mode] += 1
                else:
                    samples[mode].append(ttft)
    for connection in connections.values():
        if connection.transport is not None:
            connection.transport.close()
    out = {"modes": {}}
    for mode, values in samples.items():
        out["modes"][mode] = {
            "ttft_p50_ms": statistics.median(values) if values else None,
            "ttft_mean_ms": statistics.fmean(values) if values else None,
            "samples": len(values),
            "failures": failures[mode],
            "first_request_ttft_ms": first.get(mode),
            "tokenize_calls_per_request": tokenize[mode] / max(1, requests),
        }
    return out


def run(procs: Processes, engine: Started, engine_url: str, requests: int = 150, warmup: int = 10) -> dict:
    """Start the two gateways, measure, stop them; the result (with `error` when not measurable)."""
    directory = Path(tempfile.mkdtemp(prefix="trim-bench-"))
    started: dict[str, tuple[Started, str]] = {}
    result: dict = {
        "history_messages": HISTORY_MESSAGES,
        "history_tokens_at_standin": None,
        "requests_per_mode": requests,
        "goal_ms": GOAL_MS,
    }
    try:
        for mode in ("auto", "off"):
            port = free_port()
            config = gateway_config(engine_url, mode, directory)
            argv = [PYTHON, "-m", "server", "serve", "--config", str(config), "--port", str(port)]
            started[mode] = (procs.start(f"gateway-trim-{mode}", argv, core=PROXY_CORE), f"http://127.0.0.1:{port}")
        for mode, (process, url) in started.items():
            error = wait_chat_ready(process, url, MODEL)
            if error:
                result["error"] = f"gateway with trimming {mode} not available: {error}"
                print(f"!! trimming benchmark skipped: {result['error']}", file=sys.stderr)
                return result
        tokens = httpx.post(f"{engine_url}/tokenize", json={"model": MODEL, "messages": history(HISTORY_MESSAGES)})
        result["history_tokens_at_standin"] = tokens.json().get("count")
        _use_uvloop()
        measured = asyncio.run(
            _measure({mode: url for mode, (_, url) in started.items()}, engine_url, requests, warmup)
        )
        result.update(measured)
        on, off = measured["modes"]["auto"]["ttft_p50_ms"], measured["modes"]["off"]["ttft_p50_ms"]
        result["added_ttft_p50_ms"] = None if on is None or off is None else on - off
        result["goal_met"] = None if result["added_ttft_p50_ms"] is None else result["added_ttft_p50_ms"] < GOAL_MS
        return result
    finally:
        for process, _ in started.values():
            procs.stop(process)


def summary_line(result: dict) -> str:
    if result.get("error"):
        return f"trimming benchmark not measured: {result['error'].splitlines()[0]}"
    modes = result["modes"]
    return (
        f"trimming ({result['history_messages']} messages, {result['history_tokens_at_standin']} tokens): "
        f"gateway TTFT p50 {modes['auto']['ttft_p50_ms']:.2f} ms with trimming, {modes['off']['ttft_p50_ms']:.2f} ms "
        f"without: +{result['added_ttft_p50_ms']:.2f} ms (goal < {GOAL_MS:g} ms: "
        f"{'met' if result['goal_met'] else 'NOT met'}); "
        f"{modes['auto']['tokenize_calls_per_request']:.2f} tokenize calls per request"
    )


def render_markdown(result: dict, heading: str = "#") -> str:
    lines = [
        f"{heading} Trimming benchmark: a {result['history_messages']}-message history, only the newest message new",
        "",
        "Two gateways (trimming `auto` vs `off`, otherwise identical) on core 1 in front of the same stand-in "
        "engine; one client on core 0 alternates between them, one request at a time, "
        f"{result['requests_per_mode']} measured requests each after a warm-up.",
        "",
    ]
    if result.get("error"):
        return "\n".join([*lines, f"Not measured: {result['error'].splitlines()[0]}"])
    lines += ["| trimming | TTFT p50 ms | TTFT mean ms | first request TTFT ms | tokenize calls / request | failures |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for mode, figures in result["modes"].items():
        first = figures["first_request_ttft_ms"]
        lines.append(
            f"| {mode} | {figures['ttft_p50_ms']:.2f} | {figures['ttft_mean_ms']:.2f} | "
            f"{'n/a' if first is None else f'{first:.2f}'} | {figures['tokenize_calls_per_request']:.2f} | "
            f"{figures['failures']} |"
        )
    lines += ["", summary_line(result)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trim_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--output", type=Path, default=None, help="write trim.json and trim.md here")
    args = parser.parse_args(argv)
    import os

    try:
        os.sched_setaffinity(0, {CLIENT_CORE})
    except (AttributeError, OSError):
        pass
    with Processes() as procs:
        port = free_port()
        engine = procs.start(
            "standin",
            [PYTHON, "-m", "standin", "--port", str(port), "--model", MODEL, "--max-model-len", "32768"],
            core=CLIENT_CORE,
        )
        engine_url = f"http://127.0.0.1:{port}"
        error = wait_chat_ready(engine, engine_url, MODEL)
        if error:
            print(f"the stand-in engine did not start: {error}", file=sys.stderr)
            return 1
        result = run(procs, engine, engine_url, requests=args.requests)
    print(summary_line(result))
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "trim.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.output / "trim.md").write_text(render_markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
