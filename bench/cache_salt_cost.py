"""What `cache_isolation: tenant` costs a request, side by side in one run (a micro-benchmark).

The gateway's added work for an isolated tenant's request, measured on the real functions:
- the body: `CacheSalts.body_for` (a dict copy with the salt) and `GatewayRequest.replace_body`
  (one more serialization of the body the engine gets), against the unisolated path
  (`without_claims`, which leaves a body without claims alone);
- the prefix indexes: `request_namespace` (a digest of the salt) and the salted text blocks'
  root, against unsalted text blocks.
For chat bodies of several sizes. Each figure is the median over `--rounds` rounds of the mean
CPU time (this thread's) of `--iterations` calls, with the range over rounds; ratios compare the
two paths of one round.

    python -m bench.cache_salt_cost [--rounds 15] [--iterations 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import server
from server.gateway.jsonio import dumps
from server.gateway.replicas.blocks import prompt_text, request_namespace, text_blocks
from server.gateway.request.endpoints import BY_NAME
from server.gateway.request.request import parse_request
from server.gateway.tenants.directory import without_claims
from server.gateway.tenants.isolation import CacheSalts, tenant_salt

SIZES = {"small (1 turn)": 1, "medium (20 turns)": 20, "large (200 turns)": 200}


def body_of(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are the travel desk. " * 20}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what about two days in Lisbon, and the trains?"})
        answer = f"Answer {turn}: take the 8:00 Alfa Pendular, book ahead. " * 3
        messages.append({"role": "assistant", "content": answer})
    return {"model": "tiny", "messages": messages, "max_tokens": 64, "stream": True, "cache_salt": "client-chosen"}


def mean_ns(fn: Callable[[], object], iterations: int) -> float:
    """CPU nanoseconds of this thread per call: on a shared machine, wall time would count the
    time the process waited for a core (at a load of 18 on 2 cores it inflated every figure 5x)."""
    start = time.thread_time_ns()
    for _ in range(iterations):
        fn()
    return (time.thread_time_ns() - start) / iterations


def measure(turns: int, rounds: int, iterations: int) -> dict[str, Any]:
    endpoint = BY_NAME["chat"]
    body = body_of(turns)
    raw = dumps(body)
    salts = CacheSalts({"planner": tenant_salt(b"s" * 64, "planner")})
    text = prompt_text(body) or ""

    def shared() -> None:  # what _admit does to a shared tenant's body
        request = parse_request(raw, endpoint)
        changed = without_claims(request.body)
        if changed is not None:
            request.replace_body(changed)

    def isolated() -> None:  # ... and to an isolated tenant's
        request = parse_request(raw, endpoint)
        changed = without_claims(request.body)
        changed = salts.body_for("planner", endpoint.name, changed or request.body) or changed
        if changed is not None:
            request.replace_body(changed)

    salted_body = salts.body_for("planner", "chat", body) or body

    def blocks_unsalted() -> None:
        text_blocks(text, 256, namespace=request_namespace("", body_of_no_salt))

    def blocks_salted() -> None:
        text_blocks(text, 256, namespace=request_namespace("", salted_body))

    body_of_no_salt = {k: v for k, v in body.items() if k != "cache_salt"}
    pairs = {"body": (shared, isolated), "prefix blocks": (blocks_unsalted, blocks_salted)}
    out: dict[str, Any] = {"turns": turns, "body_bytes": len(raw), "prompt_chars": len(text)}
    for name, (before, after) in pairs.items():
        base, salted, added, ratio = [], [], [], []
        for index in range(rounds):  # alternating which goes first, so a drift in load favours neither
            if index % 2:
                a = mean_ns(after, iterations)
                b = mean_ns(before, iterations)
            else:
                b = mean_ns(before, iterations)
                a = mean_ns(after, iterations)
            base.append(b)
            salted.append(a)
            added.append(a - b)
            ratio.append(a / b)
        out[name] = {
            "unisolated_us": _summary([x / 1000 for x in base]),
            "isolated_us": _summary([x / 1000 for x in salted]),
            "added_us": _summary([x / 1000 for x in added]),
            "ratio": _summary(ratio),
        }
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=False).stdout)
    result: dict[str, Any] = {
        "bench": "cache_salt_cost",
        "commit": commit,
        "dirty_tree": dirty,
        "server_package": str(Path(server.__file__).parent),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "rounds": args.rounds,
        "iterations": args.iterations,
        "sizes": {},
    }
    for label, turns in SIZES.items():
        result["sizes"][label] = measure(turns, args.rounds, max(50, args.iterations // max(1, turns // 10)))
    result["loadavg_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
