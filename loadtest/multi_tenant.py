"""A multi-tenant load: one API key per tenant, each tenant with its own workload shape and rate,
reported per tenant and per class (issue 32: who goes first when the engines are full).

A tenant is given on the command line as `name=planner,key=sk-...,class=interactive,shape=chat,...`
(`--tenant`, repeatable; `key=env:VAR` reads the key from the environment):

- `shape=chat`: conversations of `turns` turns, each turn sent when the previous answer ended
  (plus `think` s), carrying the history; `rate` new conversations a second (`requests`
  conversations in all);
- `shape=batch`: single requests behind one shared system prompt (`prompt_chars` long),
  `rate` a second (0: all at once), `requests` in all;
- `shape=unique`: like batch, but every prompt different (nothing for the prefix cache).

Every request is streamed (loadtest.client: the same timings as the other scenarios); `class`
is only a label for the report (the gateway takes the class from the key's tenant). The report:
per tenant and per class, requests, successes, 429s (and other errors), TTFT p50/p90/max,
output tokens per second over the tenant's own span (throughput), and goodput: answers that
succeeded with TTFT within `--slo-ttft` (per class: `--slo-ttft interactive=1,batch=60`), per
second.

Usage: python -m loadtest.multi_tenant --url http://127.0.0.1:8000 --model tiny
           --tenant name=planner,key=env:PLANNER_KEY,class=interactive,shape=chat,turns=12,rate=0.2,requests=2
           --tenant name=articles,key=env:ARTICLES_KEY,class=batch,shape=batch,rate=0,requests=100,max_tokens=256
           [--slo-ttft interactive=1,standard=5,batch=60] [--output report.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.client import ChatClient, make_http_client
from loadtest.metrics import percentile
from loadtest.records import RequestRecord
from loadtest.texts import ARTICLES_SYSTEM_PROMPT, CITIES, SYSTEM_PROMPT

SHAPES = ("chat", "batch", "unique")
CLASSES = ("interactive", "standard", "batch")


class SpecError(ValueError):
    """A `--tenant` or `--slo-ttft` value that does not parse."""


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's workload (every field a key of `--tenant`)."""

    name: str
    key: str = field(repr=False)
    klass: str = "standard"
    shape: str = "batch"
    rate: float = 1.0  # new requests (chat: conversations) a second; 0: all at once
    requests: int = 10
    turns: int = 1
    max_tokens: int = 32
    prompt_chars: int = 1200
    think: float = 0.0


def parse_tenant(text: str, environ: dict[str, str] | None = None) -> TenantLoad:
    """`name=...,key=...,class=...,shape=...,rate=...,requests=...,turns=...,max_tokens=...`."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise SpecError(f"--tenant {text!r}: expected key=value pairs separated by commas")
        values[name.strip()] = value.strip()
    if "name" not in values or "key" not in values:
        raise SpecError(f"--tenant {text!r}: needs name= and key=")
    key = values.pop("key")
    if key.startswith("env:"):
        if key[4:] not in environ:
            raise SpecError(f"--tenant {values['name']}: ${key[4:]} is not set")
        key = environ[key[4:]]
    klass = values.pop("class", "standard")
    if klass not in CLASSES:
        raise SpecError(f"--tenant {values['name']}: class must be one of {', '.join(CLASSES)}")
    shape = values.pop("shape", "batch")
    if shape not in SHAPES:
        raise SpecError(f"--tenant {values['name']}: shape must be one of {', '.join(SHAPES)}")
    numbers: dict[str, Any] = {}
    for name, kind in (("rate", float), ("requests", int), ("turns", int), ("max_tokens", int),
                       ("prompt_chars", int), ("think", float)):  # fmt: skip
        if name in values:
            try:
                numbers[name] = kind(values.pop(name))
            except ValueError:
                raise SpecError(f"--tenant {values['name']}: {name} must be a number") from None
            if numbers[name] < 0:
                raise SpecError(f"--tenant {values['name']}: {name} must not be negative")
    name = values.pop("name")
    if values:
        raise SpecError(f"--tenant {name}: unknown keys {', '.join(sorted(values))}")
    return TenantLoad(name=name, key=key, klass=klass, shape=shape, **numbers)


def parse_slo(text: str) -> dict[str, float]:
    """`interactive=1,batch=60` (seconds of TTFT per class), or one number for every class."""
    try:
        if "=" not in text:
            return dict.fromkeys(CLASSES, float(text))
        out = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name.strip() not in CLASSES:
                raise SpecError(f"--slo-ttft: unknown class {name.strip()!r}")
            out[name.strip()] = float(value)
        return out
    except ValueError as exc:
        raise SpecError(f"--slo-ttft {text!r}: {exc}") from None


def prompt(load: TenantLoad, index: int) -> list[dict[str, str]]:
    """The first messages of request `index` of `load`'s shape."""
    if load.shape == "chat":
        return [{"role": "system", "content": SYSTEM_PROMPT}]
    if load.shape == "batch":
        system = (ARTICLES_SYSTEM_PROMPT * (1 + load.prompt_chars // len(ARTICLES_SYSTEM_PROMPT)))[: load.prompt_chars]
    else:
        rng = random.Random(f"{load.name}-{index}")
        system = " ".join(f"{rng.choice(CITIES)}-{rng.randrange(10**6)}" for _ in range(load.prompt_chars // 8))
        system = system[: load.prompt_chars]
    city = CITIES[index % len(CITIES)]
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Request {index}: write about {city}."}]


async def run_tenant(client: ChatClient, load: TenantLoad, origin: float) -> list[RequestRecord]:
    """Every request of `load`, at its rate; conversations turn by turn."""
    records: list[RequestRecord] = []

    async def one(index: int) -> None:
        messages = prompt(load, index)
        for turn in range(max(1, load.turns if load.shape == "chat" else 1)):
            if load.shape == "chat":
                messages.append({"role": "user", "content": f"Turn {turn}: and then, in {CITIES[turn % len(CITIES)]}?"})
            record = RequestRecord(request_id=f"{load.name}-{index}-{turn}", target=load.name, turn=turn)
            record.session_id = f"{load.name}-{index}"
            record.max_tokens = load.max_tokens
            record.scheduled_s = time.perf_counter() - origin
            records.append(record)
            answer = await client.stream(record, list(messages), origin=origin)
            if record.error_kind is not None:
                return
            messages.append({"role": "assistant", "content": answer.text or "ok"})
            if load.think:
                await asyncio.sleep(load.think)

    tasks = []
    for index in range(load.requests):
        tasks.append(asyncio.ensure_future(one(index)))
        if load.rate > 0 and index + 1 < load.requests:
            await asyncio.sleep(1.0 / load.rate)
    await asyncio.gather(*tasks)
    return records


def summarize(records: list[RequestRecord], slo_s: float | None) -> dict[str, Any]:
    """Requests, successes, 429s, TTFT, throughput and goodput of a set of records."""
    ok = [r for r in records if r.status == 200 and r.error_kind is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.sent_s + (r.closed_s or 0.0) for r in records), default=0.0)
    span = max(end - start, 1e-9)
    good = [r for r in ok if slo_s is None or (r.ttft_s is not None and r.ttft_s <= slo_s)]
    return {
        "requests": len(records),
        "ok": len(ok),
        "rejected_429": sum(1 for r in records if r.status == 429),
        "errors_other": sum(1 for r in records if r.status != 429 and (r.status != 200 or r.error_kind)),
        "ttft_s": {
            "p50": percentile(ttfts, 50) if ttfts else None,
            "p90": percentile(ttfts, 90) if ttfts else None,
            "max": max(ttfts) if ttfts else None,
        },
        "output_tokens": sum(r.completion_tokens or 0 for r in ok),
        "throughput_tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / span,
        "goodput_per_s": len(good) / span,
        "good": len(good),
        "slo_ttft_s": slo_s,
        "span_s": span,
    }


def report(loads: list[TenantLoad], results: dict[str, list[RequestRecord]], slo: dict[str, float]) -> dict[str, Any]:
    by_class: dict[str, list[RequestRecord]] = {}
    tenants = {}
    for load in loads:
        records = results[load.name]
        by_class.setdefault(load.klass, []).extend(records)
        tenants[load.name] = {
            "class": load.klass,
            "workload": {k: v for k, v in asdict(load).items() if k != "key"},
            **summarize(records, slo.get(load.klass)),
        }
    classes = {klass: summarize(records, slo.get(klass)) for klass, records in by_class.items()}
    return {"tenants": tenants, "classes": classes}


def render(result: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return f"{value * 1000:.0f}" if value is not None else "-"

    lines = [
        f"{'':<14}{'class':<12}{'req':>5}{'ok':>5}{'429':>5}{'err':>5}{'ttft p50':>10}{'p90':>8}{'max':>8}"
        f"{'tok/s':>9}{'good/s':>8}"
    ]
    for title, rows in (("tenant", result["tenants"]), ("class", result["classes"])):
        lines.append(f"-- by {title}")
        for name, s in rows.items():
            t = s["ttft_s"]
            lines.append(
                f"{name:<14}{s.get('class', name):<12}{s['requests']:>5}{s['ok']:>5}{s['rejected_429']:>5}"
                f"{s['errors_other']:>5}{ms(t['p50']):>10}{ms(t['p90']):>8}{ms(t['max']):>8}"
                f"{s['throughput_tokens_per_s']:>9.1f}{s['goodput_per_s']:>8.2f}"
            )
    return "\n".join(lines) + "\n(TTFT in ms)"


async def run(url: str, model: str, loads: list[TenantLoad], slo: dict[str, float], timeout_s: float) -> dict:
    http = make_http_client(max_connections=4096, timeout_s=timeout_s)
    try:
        origin = time.perf_counter()
        clients = [ChatClient(url, http=http, model=model, api_key=load.key, timeout_s=timeout_s) for load in loads]
        done = await asyncio.gather(*(run_tenant(c, load, origin) for c, load in zip(clients, loads, strict=True)))
    finally:
        await http.aclose()
    return report(loads, {load.name: records for load, records in zip(loads, done, strict=True)}, slo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tenant", action="append", required=True, help="name=...,key=...,class=...,shape=...")
    parser.add_argument("--slo-ttft", default="interactive=1,standard=5,batch=60", help="seconds, per class")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--output", help="write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        loads = [parse_tenant(text) for text in args.tenant]
        slo = parse_slo(args.slo_ttft)
    except SpecError as exc:
        parser.error(str(exc))
    names = [load.name for load in loads]
    if len(set(names)) != len(names):
        parser.error("--tenant names must be unique")
    result = asyncio.run(run(args.url, args.model, loads, slo, args.timeout))
    print(render(result))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
