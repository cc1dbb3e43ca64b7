"""Prefix-cache hits of trimmed conversations, per turn: watermark vs moving window, from a load test.

Reads the `requests.jsonl` (or `.jsonl.gz`) that `python -m loadtest` wrote for a paired run of
two targets (e.g. the same gateway with `x-trim-mode: auto` and `x-trim-mode: window`, with
`--record-header x-trim-status`), and prints, per target and turn, the prompt tokens, the
prompt tokens the engine took from its prefix cache (`usage.prompt_tokens_details.cached_tokens`)
and the TTFT (one row per session and turn; with `--median`, medians over sessions); then, per
target, over the trimmed turns (x-trim-status `trimmed`, i.e. every turn
from the first cut on): the cached share of prompt tokens, the median TTFT, and the tokens
prefilled (prompt - cached) over the whole run.

Usage: python -m bench.trim_cache loadtest/results/watermark-trimming/itinerary [--median] [--json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(directory: Path) -> list[dict[str, Any]]:
    plain, packed = directory / "requests.jsonl", directory / "requests.jsonl.gz"
    if plain.exists():
        text = plain.read_text()
    else:
        text = gzip.decompress(packed.read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _status(record: dict[str, Any]) -> str:
    headers = record.get("headers") or {}
    return str(headers.get("x-trim-status", "-"))


def summarise(records: list[dict[str, Any]], *, by_session: bool = True) -> dict[str, Any]:
    """Per target: per-turn rows (per session, or medians over sessions) and the trimmed-turn totals."""
    by_target: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("phase") == "measure" and record.get("error_kind") is None:
            by_target[record["target"]].append(record)
    sessions = sorted({str(r.get("session_id")) for rows in by_target.values() for r in rows})
    out: dict[str, Any] = {}
    for target, rows in by_target.items():
        turns: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            turns[(str(row.get("session_id")) if by_session else "", row["turn"])].append(row)
        per_turn = []
        for session, turn in sorted(turns):
            group = turns[(session, turn)]
            per_turn.append(
                {
                    "session": sessions.index(session) + 1 if by_session else None,
                    "turn": turn + 1,
                    "requests": len(group),
                    "status": ",".join(sorted({_status(r) for r in group})),
                    "prompt_tokens": statistics.median(r["prompt_tokens"] for r in group),
                    "cached_tokens": statistics.median(r["cached_tokens"] or 0 for r in group),
                    "ttft_ms": statistics.median(1000 * r["ttft_s"] for r in group),
                }
            )
        trimmed = [r for r in rows if _status(r) == "trimmed"]
        prompt = sum(r["prompt_tokens"] for r in trimmed)
        cached = sum(r["cached_tokens"] or 0 for r in trimmed)
        first_trim = min((r["turn"] + 1 for r in trimmed), default=None)
        out[target] = {
            "turns": per_turn,
            "requests": len(rows),
            "trimmed_requests": len(trimmed),
            "first_trimmed_turn": first_trim,
            "trimmed_prompt_tokens": prompt,
            "trimmed_cached_tokens": cached,
            "trimmed_cached_share": cached / prompt if prompt else float("nan"),
            "trimmed_median_ttft_ms": statistics.median(1000 * r["ttft_s"] for r in trimmed) if trimmed else None,
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "prefilled_tokens": sum(r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rows),
        }
    return out


def markdown(summary: dict[str, Any]) -> str:
    targets = list(summary)
    keys = sorted({(r["session"] or 0, r["turn"]) for t in targets for r in summary[t]["turns"]})
    by_key = {t: {(r["session"] or 0, r["turn"]): r for r in summary[t]["turns"]} for t in targets}
    lines = [
        "| session | turn | " + " | ".join(f"{t}: status | prompt | cached | TTFT ms" for t in targets) + " |",
        "|---:|---:|" + "---|---:|---:|---:|" * len(targets),
    ]
    for key in keys:
        cells = []
        for t in targets:
            r = by_key[t].get(key)
            if r is None:
                cells.append("- | - | - | -")
            else:
                cells.append(
                    f"{r['status']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | {r['ttft_ms']:.0f}"
                )
        lines.append(f"| {key[0] or 'all'} | {key[1]} | " + " | ".join(cells) + " |")
    lines += ["", "| over the trimmed turns | " + " | ".join(targets) + " |", "|---|" + "---:|" * len(targets)]
    for key, name, fmt in (
        ("first_trimmed_turn", "first trimmed turn", "{}"),
        ("trimmed_requests", "trimmed requests", "{}"),
        ("trimmed_prompt_tokens", "prompt tokens", "{:,}"),
        ("trimmed_cached_tokens", "cached tokens", "{:,}"),
        ("trimmed_cached_share", "**cached share**", "**{:.3f}**"),
        ("trimmed_median_ttft_ms", "**median TTFT (ms)**", "**{:.1f}**"),
        ("prompt_tokens", "prompt tokens, whole run", "{:,}"),
        ("prefilled_tokens", "**tokens prefilled, whole run** (prompt - cached)", "**{:,}**"),
    ):
        cells = [fmt.format(summary[t][key]) if summary[t][key] is not None else "-" for t in targets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a `python -m loadtest --output` directory")
    parser.add_argument("--median", action="store_true", help="per turn, the median over sessions")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    summary = summarise(load(args.directory), by_session=not args.median)
    sys.stdout.write(json.dumps(summary, indent=2) + "\n" if args.json else markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
