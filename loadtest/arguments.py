"""The load tester's command-line arguments: `build_parser()` and the parsers of their values."""

from __future__ import annotations

import argparse
import json
import os

from loadtest import aio, scenarios
from loadtest.client import HTTP_CLIENTS
from loadtest.loop_lag import Limits
from loadtest.schedule import ARRIVALS

EPILOG = """\
load shapes:
  closed loop   --concurrency 4          4 users, each sends its next request when the
                                         previous answer arrived (a list sweeps: 1,2,4,8)
  open loop     --rate 2 [--arrival poisson|gamma --burstiness B] [--concurrency 8]
                                         new requests (sessions) at 2/s on average; the
                                         concurrency becomes a ceiling (a rate list sweeps)
stop:           --num-requests N (measured, after --warmup) and/or --duration SECONDS

scenarios:
  itinerary  trip-planning sessions: ~500-char system prompt + ~2,000 chars of retrieved
             points of interest + growing history, --turns per session (default 8)
  articles   --num-prompts prompts (default 100) sharing a ~500-char system prompt
  random     --input-chars / --max-tokens, --length-dist fixed|uniform|normal
  file       --file requests.jsonl ({"messages": [...]}, {"prompt": "..."} or
             {"system": "...", "turns": ["...", "..."]} per line)

outputs (in --output DIR): requests.jsonl, summary.json, report.md, ttft.png, itl.png,
latency_over_time.png, turns.png (multi-turn)

the load generator times its own event loop; when it lagged more than --loop-lag-limit (5 ms)
at p99, or an open-loop run fell more than 5 % behind its rate, the terminal, summary.json
(generator_warnings) and report.md say so. Per request it keeps usage.prompt_tokens_details.
cached_tokens; multi-turn runs print the cached share per turn.

exit codes: 0 ok; 1 an --slo was missed (attainment below --slo-attainment);
2 bad arguments or scenario; 3 a run completed no request at all.

examples:
  python -m loadtest --url http://127.0.0.1:8000 --model tiny --scenario itinerary
  python -m loadtest --url http://127.0.0.1:8100 --model tiny --scenario articles \\
      --compare http://127.0.0.1:8101 --label-a caching-on --label-b caching-off
  python -m loadtest --url http://127.0.0.1:8000/v1 --model tiny --scenario random \\
      --rate 4 --duration 30 --slo ttft:500ms --slo e2e:5s
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be at least 1")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def _warmup(text: str) -> tuple[int, float]:
    """`5` -> the first 5 requests; `10s` -> requests sent in the first 10 seconds."""
    try:
        if text.endswith("s"):
            return 0, float(text[:-1])
        return int(text), 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warmup takes a count (5) or seconds (10s): {text!r}") from None


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"headers look like 'name: value': {text!r}")
    return name.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load-test an OpenAI-compatible chat endpoint from outside, as a client: "
        "streamed requests, TTFT/TPOT/ITL/E2E, throughput, goodput, errors by kind.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url", required=True, help="the server's base URL, with or without /v1 (e.g. http://127.0.0.1:8000)"
    )
    target.add_argument("--model", required=True, help="the model name to send")
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    target.add_argument(
        "--header",
        action="append",
        type=_header,
        default=[],
        metavar="'K: V'",
        help="extra request header (repeatable)",
    )
    target.add_argument(
        "--record-header",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this response header in requests.jsonl (repeatable; e.g. x-trim-status)",
    )
    target.add_argument(
        "--metrics-url",
        help="a vLLM /metrics URL to sample KV-cache usage "
        "during the run (per request and per turn) and prefix-cache hits per run",
    )
    target.add_argument(
        "--engine-timings-url",
        metavar="URL",
        help="a server's per-request timings (the stand-in's /_standin/timings): "
        "joined with ours by x-request-id, the summary gets the load "
        "tester's own added TTFT (median_added_ttft_ms, ...)",
    )
    target.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="raw",
        help="HTTP machinery: raw (asyncio + httptools, default; measured "
        "exact up to the limits in the README) or httpx",
    )
    target.add_argument(
        "--loop", choices=aio.LOOPS, default="auto", help="event loop: uvloop when installed (auto), or asyncio"
    )
    target.add_argument(
        "--metrics-interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often --metrics-url is sampled during a run (0.1)",
    )

    work = parser.add_argument_group("workload")
    work.add_argument(
        "--scenario",
        choices=scenarios.SCENARIOS,
        default="itinerary",
        help="the workload (default itinerary; see below)",
    )
    work.add_argument("--file", help="JSONL file for --scenario file")
    work.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    work.add_argument(
        "--max-tokens", type=int, default=64, help="max_tokens per request (default 64; the mean for --length-dist)"
    )
    work.add_argument(
        "--ignore-eos", action="store_true", help="send vLLM's ignore_eos so every answer has --max-tokens tokens"
    )
    work.add_argument(
        "--extra-body", type=json.loads, default=None, metavar="JSON", help="JSON object merged into every request body"
    )
    work.add_argument("--turns", type=int, default=8, help="itinerary: turns per session (8)")
    work.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pause between an answer and the session's next turn (0)",
    )
    work.add_argument(
        "--system-chars", type=int, default=500, help="itinerary/articles: system prompt size in characters (500)"
    )
    work.add_argument(
        "--context-chars", type=int, default=2000, help="itinerary: retrieved POI context in characters (2000)"
    )
    work.add_argument("--num-prompts", type=int, default=100, help="articles: prompts (100)")
    work.add_argument("--input-chars", type=int, default=1000, help="random: prompt size in characters (1000)")
    work.add_argument(
        "--length-dist",
        choices=("fixed", "uniform", "normal"),
        default="fixed",
        help="random: distribution of input chars and max_tokens (fixed)",
    )
    work.add_argument(
        "--length-spread",
        type=float,
        default=0.25,
        help="random: uniform +-fraction, or normal sd as a fraction (0.25)",
    )
    work.add_argument(
        "--end-session-on-error",
        action="store_true",
        help="abandon a session after a failed turn (default: go on with the "
        "next turn, the failed one left out of the history)",
    )

    load = parser.add_argument_group("load shape and stop")
    load.add_argument(
        "--concurrency",
        type=_int_list,
        default=None,
        metavar="N[,N...]",
        help="closed-loop users (default 4); with --rate, a ceiling on requests in flight; a list sweeps",
    )
    load.add_argument(
        "--rate",
        type=_float_list,
        default=None,
        metavar="R[,R...]",
        help="open loop: new sessions per second (a request each for single-turn scenarios); a list sweeps",
    )
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="open-loop arrivals (poisson)")
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier, >1 smoother than Poisson (1)"
    )
    load.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests per run (default: itinerary 32, articles "
        "--num-prompts, random 50, file: every request once)",
    )
    load.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop starting requests this long after the first measured one",
    )
    load.add_argument(
        "--warmup",
        type=_warmup,
        default=(0, 0.0),
        metavar="N|Ns",
        help="requests (5) or seconds (10s) at the start excluded from metrics",
    )
    load.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take in total (60)")

    ab = parser.add_argument_group("A/B comparison")
    ab.add_argument("--compare", metavar="URL2", help="run the same workload against URL2 (B)")
    ab.add_argument(
        "--compare-mode",
        choices=("sequential", "paired"),
        default="sequential",
        help="sequential: the whole run on A, then on B (default); paired: every "
        "turn goes to A and B back to back (order alternating per session), "
        "for small differences on a noisy machine",
    )
    ab.add_argument("--compare-model", help="model name at URL2 (default: --model)")
    ab.add_argument(
        "--compare-header",
        action="append",
        type=_header,
        default=[],
        metavar="'K: V'",
        help="extra header for B only (e.g. 'x-trim-mode: off')",
    )
    ab.add_argument("--compare-metrics-url", help="B's /metrics URL")
    ab.add_argument("--label-a", default="A", help="name of the --url target in reports")
    ab.add_argument("--label-b", default="B", help="name of the --compare target in reports")

    out = parser.add_argument_group("output and SLOs")
    out.add_argument("--output", metavar="DIR", help="where to write the results (default loadtest/out/SCENARIO-TIME)")
    out.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="KEY:VALUE",
        help="per-request objective: ttft:500ms, tpot:50ms, e2e:5s (repeatable)",
    )
    out.add_argument(
        "--slo-attainment", type=float, default=0.95, help="share of requests that must meet every --slo (0.95)"
    )
    out.add_argument(
        "--progress",
        choices=("auto", "tty", "plain", "off"),
        default="auto",
        help="live progress: rewritten line on a terminal, plain lines otherwise",
    )
    out.add_argument(
        "--loop-lag-limit",
        type=float,
        default=Limits().p99_loop_lag_ms,
        metavar="MS",
        help="warn that the load generator was saturated when its event loop lagged more than this at p99 (5)",
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser
