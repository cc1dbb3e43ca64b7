"""The metric formulas, over recorded timings only (no I/O, no clock).

Names follow vLLM's `bench serve` result JSON (`mean_ttft_ms`, `p99_itl_ms`, `request_goodput`,
...) so tools that read those files read ours; `ALIASES` gives the other tools' names for the
same quantity. Definitions (README "Load testing"; all per measured request that succeeded):

- TTFT = first token chunk with text - send.
- TPOT = (E2E - TTFT) / (completion_tokens - 1), requests with at least 2 tokens.
- ITL = every gap between consecutive token chunks from the TTFT chunk on, pooled over requests.
- E2EL = last token chunk - send (the usage chunk and `[DONE]` are not counted).
- duration = last measured request over - first measured request sent.
- request_throughput = completed / duration; output_throughput = sum(completion_tokens) /
  duration; total_token_throughput = sum(prompt_tokens + completion_tokens) / duration.
- request_goodput = requests meeting every SLO / duration; slo_attainment = the same count /
  (completed + failed), so errors count as misses.
- lateness = send - scheduled, per request (measured and failed alike).
- cached_token_ratio = sum(cached_tokens) / sum(prompt_tokens) over the successful requests
  whose `usage.prompt_tokens_details.cached_tokens` the server reported (vLLM: with
  `--enable-prompt-tokens-details`); NaN when none did. 0..1.
- achieved_rate = (session starts - 1) / (last start - first start): for open-loop runs, the
  rate the generator actually kept (single-turn scenarios: requests per second).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from loadtest.records import ERROR_KINDS, RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")

# Same quantity, other tools' names (see the research notes, A.7).
ALIASES = {
    "ttft": "GuideLLM time_to_first_token_ms; AIPerf time_to_first_token; llmperf ttft_s",
    "tpot": "GuideLLM inter_token_latency_ms; AIPerf/genai-perf inter_token_latency (ITL)",
    "itl": "AIPerf inter_chunk_latency (ICL); no GuideLLM equivalent",
    "e2el": "GuideLLM request_latency; AIPerf request_latency; llmperf end_to_end_latency_s",
    "output_throughput": "GuideLLM output_tokens_per_second; AIPerf output_token_throughput",
    "request_goodput": "AIPerf goodput (good_request_count / duration)",
    "slo_attainment": "AIPerf good_request_fraction",
    "lateness": "GuideLLM Start Delay; vLLM client_queue_time (under a concurrency ceiling)",
    "duration_s": "vLLM duration; GuideLLM duration; AIPerf benchmark_duration",
    "request_throughput": "vLLM request_throughput; GuideLLM requests_per_second; AIPerf request_throughput",
    "cached_token_ratio": "vLLM engine prefix_cache_hits / prefix_cache_queries, but per "
    "request from usage.prompt_tokens_details.cached_tokens",
    "achieved_rate": "GuideLLM achieved requests_per_second (open loop)",
}


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile, the same as `numpy.percentile`'s default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Sequence[float]) -> dict[str, float]:
    """mean, median, std (population), min, max and the percentiles of `values`."""
    if not values:
        return {"count": 0}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    result = {
        "count": len(values),
        "mean": mean,
        "median": percentile(values, 50),
        "std": std,
        "min": min(values),
        "max": max(values),
    }
    for p in PERCENTILES:
        result[f"p{p}"] = percentile(values, p)
    return result


def tpot_s(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (tokens - 1); None with fewer than 2 tokens or missing timings."""
    tokens = record.completion_tokens
    if record.ttft_s is None or record.e2e_s is None or tokens is None or tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (tokens - 1)


def itl_s(record: RequestRecord) -> list[float]:
    """The gaps between consecutive token chunks, from the TTFT chunk on."""
    times = record.chunk_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def measured_duration_s(records: Iterable[RequestRecord]) -> float:
    """From the first measured request sent to the last one over."""
    records = list(records)
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.sent_s for r in records)


def is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A request is good when it succeeded and meets every SLO (seconds; keys ttft/tpot/e2el).

    A TPOT SLO counts a one-token answer as TPOT 0, as vLLM does.
    """
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.e2e_s}
    return all(values[key] is not None and values[key] <= limit for key, limit in slos.items())


def summarize(
    records: Sequence[RequestRecord], *, slos: dict[str, float] | None = None, duration_s: float | None = None
) -> dict:
    """The summary of one run's measured records (warm-up records must be filtered out first).

    Latencies are reported in milliseconds (`*_ms`), as vLLM does; throughputs per second.
    """
    slos = slos or {}
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = measured_duration_s(records) if duration_s is None else duration_s
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    good = sum(1 for r in ok if is_good(r, slos)) if slos else len(ok)

    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "itl": [gap for r in ok for gap in itl_s(r)],
        "e2el": [r.e2e_s for r in ok if r.e2e_s is not None],
        "lateness": [r.lateness_s for r in records],
    }
    summary: dict = {
        "completed": len(ok),
        "failed": len(failed),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "errors": error_counts(failed),
        "error_examples": _error_examples(failed),
        "max_concurrent_requests": max_concurrency(records),
        "duration_s": duration,
        "achieved_rate": achieved_rate(records),
        **cached_share(records),
    }
    if slos:
        summary["slos_ms"] = {k: v * 1000 for k, v in slos.items()}
        summary["good_requests"] = good
        summary["request_goodput"] = per_second(good)
        summary["slo_attainment"] = good / len(records) if records else math.nan
    for name, values in series.items():
        stats = describe(values)
        for stat, value in stats.items():
            if stat == "count":
                continue
            summary[f"{stat}_{name}_ms"] = value * 1000
    return summary


def error_counts(failed: Iterable[RequestRecord]) -> dict[str, int]:
    """Failures by kind (every kind present, zeros included), plus HTTP statuses (`http_503`)."""
    counts = Counter(r.error_kind for r in failed)
    result = {kind: counts.get(kind, 0) for kind in ERROR_KINDS}
    for record in failed:
        if record.error_kind == "http" and record.status is not None:
            result[f"http_{record.status}"] = result.get(f"http_{record.status}", 0) + 1
    return result


def _error_examples(failed: Sequence[RequestRecord], limit: int = 5) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for record in failed:
        key = (record.error_kind, (record.error or "")[:120])
        if key not in seen and len(seen) < limit:
            seen[key] = {
                "kind": record.error_kind,
                "error": record.error,
                "request_id": record.request_id,
                "turn": record.turn,
            }
    return list(seen.values())


def max_concurrency(records: Sequence[RequestRecord]) -> int:
    """The peak number of requests in flight at once (sweep line over [sent, end))."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    return peak


def cached_share(records: Iterable[RequestRecord]) -> dict:
    """`total_cached_tokens`, `cached_tokens_reported` (requests) and `cached_token_ratio`."""
    reported = [r for r in records if r.ok and r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported)
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    return {
        "total_cached_tokens": cached,
        "cached_tokens_reported": len(reported),
        "cached_token_ratio": cached / prompt if prompt else math.nan,
    }


def achieved_rate(records: Sequence[RequestRecord]) -> float:
    """Session starts (turn 0) per second between the first and the last one sent."""
    starts = sorted(r.sent_s for r in records if r.turn == 0)
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return math.nan
    return (len(starts) - 1) / (starts[-1] - starts[0])


def per_turn(records: Sequence[RequestRecord]) -> list[dict]:
    """Per turn index: requests, errors, median TTFT, prompt tokens, cached tokens (sums and
    share), KV-cache usage (max), and requests the gateway trimmed."""
    turns: dict[int, list[RequestRecord]] = {}
    for record in records:
        turns.setdefault(record.turn, []).append(record)
    rows = []
    for turn in sorted(turns):
        group = turns[turn]
        ok = [r for r in group if r.ok]
        kv = [
            r.engine["vllm:kv_cache_usage_perc"] for r in group if r.engine and "vllm:kv_cache_usage_perc" in r.engine
        ]
        prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        rows.append(
            {
                "turn": turn,
                "requests": len(group),
                "errors": len(group) - len(ok),
                "median_ttft_ms": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50) * 1000,
                "median_prompt_tokens": percentile(prompt, 50) if prompt else math.nan,
                "median_prompt_chars": percentile([r.prompt_chars for r in group], 50),
                "prompt_tokens": sum(prompt),
                **cached_share(group),
                "max_kv_cache_usage": max(kv) if kv else math.nan,
                # the project's gateway says so in `x-trim-status` (kept with --record-header)
                "trimmed": sum(1 for r in group if (r.headers or {}).get("x-trim-status") == "trimmed"),
            }
        )
    return rows


RATIO_KEYS = (
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "request_throughput",
    "output_throughput",
    "failed",
)


def ratios(a: dict, b: dict, keys: Sequence[str] = RATIO_KEYS) -> dict[str, float]:
    """B / A for the headline metrics (NaN where A is 0 or a value is missing)."""
    result = {}
    for key in keys:
        va, vb = a.get(key), b.get(key)
        if (
            isinstance(va, (int, float))
            and isinstance(vb, (int, float))
            and va
            and not (math.isnan(va) or math.isnan(vb))
        ):
            result[key] = vb / va
        else:
            result[key] = math.nan
    return result


def differences(a: dict, b: dict, keys: Sequence[str] = RATIO_KEYS) -> dict[str, float]:
    """B - A for the headline metrics (for added latency, where a ratio hides the scale)."""
    result = {}
    for key in keys:
        va, vb = a.get(key), b.get(key)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            result[key] = vb - va
        else:
            result[key] = math.nan
    return result


def paired_differences(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> dict:
    """B - A per prompt, for requests both targets answered (matched by session and turn).

    The median of paired differences is the robust way to see a small added latency (such as a
    proxy's) on a noisy machine: each pair was sent with the same prompt, and in a paired run
    (`--compare-mode paired`) also at nearly the same moment. When A and B share one engine,
    the second request of a pair finds the first one's prompt in the prefix cache; paired runs
    alternate who goes first, and `balanced_*` (the mean of the median over pairs where A went
    first and the median over pairs where B went first) cancels that advantage.
    """
    by_key = {(r.session_id, r.turn): r for r in a if r.ok}
    pairs = [(by_key[(r.session_id, r.turn)], r) for r in b if r.ok and (r.session_id, r.turn) in by_key]
    result: dict = {"pairs": len(pairs)}
    for name, value in (("ttft", lambda r: r.ttft_s), ("e2el", lambda r: r.e2e_s)):
        diffs = [
            ((value(rb) - value(ra)) * 1000, ra.sent_s < rb.sent_s)
            for ra, rb in pairs
            if value(ra) is not None and value(rb) is not None
        ]
        stats = describe([d for d, _ in diffs])
        for stat in ("mean", "median", "p90"):
            result[f"{stat}_{name}_diff_ms"] = stats.get(stat, math.nan)
        a_first = [d for d, first in diffs if first]
        b_first = [d for d, first in diffs if not first]
        result[f"balanced_{name}_diff_ms"] = (
            (percentile(a_first, 50) + percentile(b_first, 50)) / 2 if a_first and b_first else math.nan
        )
    return result
