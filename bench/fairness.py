"""Issue 32's benchmarks on a real vLLM engine: priority classes and fair queueing at the gateway.

One engine of the tiny-cpu-priority profile (the tiny model, max-num-seqs 32, vLLM's priority
scheduler) and one gateway in front of it (`python -m server serve`, the flow gate on, one tenant
per workload). Each run measures, in one go:

- `chapter`: the source chapter's two workloads. The planner: a streamed conversation of
  `--turns` turns (short answers; each turn carries the history), started `--planner-delay` s
  after the batch: `--articles` article requests sharing one system prompt (long answers), sent
  at once. Four phases: the planner alone (through the gateway), the batch alone (through the
  gateway), both straight to the engine (vLLM first come first served: no `priority` field, so
  every request has vLLM's default), both through the gateway. Every turn's TTFT; the planner's
  figure is its worst turn. Goals: worst turn beside the batch <= 3x its worst alone; the batch's
  makespan beside the planner <= 1.2x alone; no request fails.
- `fair`: two batch tenants, `heavy` sending 10x `light`'s requests (same shape), all sent at
  once, heavy's first: through the gateway, then straight to the engine (FCFS). Each tenant's
  share of the tokens served (uncached prompt + output, from usage; output spread over each
  streamed answer's time) while both were backlogged: from light's first answer starting to the
  earlier of the two tenants' last answer starting (`backlogged_shares`); when light was first
  served; each tenant's median TTFT and latency. Straight to the engine, light is served only
  once heavy's backlog has started, so there may be no such window (n/a).
- `uncached`: two batch tenants with prompts of the same length, `shared`'s behind one long
  common system prompt (the prefix cache holds it), `unique`'s all different: the requests each
  got served while both were backlogged, and the gateway's counters (virtual and served tokens).
- `where` (not run by default): where the planner's slow turns beside the batch come from. The
  batch through the gateway in both phases; the planner through the gateway, then straight to the
  engine (vLLM's default `priority`, 0, the interactive class's), each alone first.

Usage: python -m bench.fairness --runs 3 --output docs/bench/fairness [--scenarios chapter,fair,uncached,where]
       [--workers 2]  (the gateway's workers: each queues its own requests, with its share of the batch)
The raw data (every request's timings) goes to OUTPUT/fairness.json, the summary to fairness.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.procs import PYTHON, ROOT, Processes, Started, commit_of, free_port
from bench.proxy_bench import machine
from loadtest.texts import ARTICLES_SYSTEM_PROMPT, CITIES, SYSTEM_PROMPT
from server.engine.profiles import load_profile
from server.engine.supervisor import EngineSupervisor, prepare

MODEL = "tiny"
PROFILE = ROOT / "configs/profiles/tiny-cpu-priority.yaml"
KEYS = {
    name: f"sk-bench-{name}-0123456789abcdef" for name in ("planner", "articles", "heavy", "light", "shared", "unique")
}
CLASSES = {"planner": "interactive"}  # every other tenant is batch


def gateway_config(engine_url: str, access_log: bool = False) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "profile": str(PROFILE), "urls": [engine_url]}],
        "tenants": [
            {"name": name, "api_keys": [key], "priority": CLASSES.get(name, "batch")} for name, key in KEYS.items()
        ],
        "timeouts": {"first_byte": 900.0, "idle": 300.0, "total": 1800.0},
        "flow": {"max_wait": {"interactive": 120.0, "standard": 600.0, "batch": 850.0}},
        "metrics_scrape_interval": 1.0,
        "access_log": access_log,  # off unless asked for (--access-log): one line a request
    }


# -- one request ------------------------------------------------------------------------------------


async def chat(
    client: httpx.AsyncClient,
    url: str,
    tenant: str | None,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    stream: bool,
    t0: float,
) -> dict[str, Any]:
    """One chat request; its times (from `t0`), status, usage, answer text."""
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # answers of exactly max_tokens: the random model would stop anywhere
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    out: dict[str, Any] = {"tenant": tenant, "sent": start - t0, "status": 0, "ttft": None, "usage": None}
    try:
        if stream:
            text = []
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                out["status"] = response.status_code
                async for line in sse_lines(response):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        out["usage"] = event["usage"]
                    for choice in event.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if out["ttft"] is None:
                                out["ttft"] = time.perf_counter() - start
                            text.append(content)
                out["text"] = "".join(text)
        else:
            response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            out["status"] = response.status_code
            if response.status_code == 200:
                answer = response.json()
                out["usage"] = answer.get("usage")
                out["text"] = answer["choices"][0]["message"]["content"] or ""
            else:
                out["error"] = response.text[:300]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["done"] = time.perf_counter() - t0
    return out


async def sse_lines(response: httpx.Response) -> Any:
    """The stream's lines split at b"\n" only. httpx's aiter_lines splits like str.splitlines, also
    at U+2028, U+0085 and the like, which JSON leaves unescaped: the tiny model's random tokens
    write them, and a data line cut there is not JSON."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


def served_tokens(result: dict[str, Any]) -> int:
    """Uncached prompt + output tokens of an answer (its usage)."""
    usage = result.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return max(0, usage.get("prompt_tokens", 0) - cached) + usage.get("completion_tokens", 0)


# -- workloads --------------------------------------------------------------------------------------


def article_messages(i: int, run: int) -> list[dict[str, str]]:
    city = CITIES[i % len(CITIES)]
    return [
        {"role": "system", "content": ARTICLES_SYSTEM_PROMPT * 2},
        {"role": "user", "content": f"Write article {run}-{i}: a long feature on {city}, its history and food."},
    ]


async def planner(client: httpx.AsyncClient, url: str, tenant: str | None, args: Any, t0: float) -> list[dict]:
    """The interactive planner: `args.turns` streamed turns, each with the history so far."""
    rng = random.Random(7)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    turns = []
    for turn in range(args.turns):
        city = CITIES[rng.randrange(len(CITIES))]
        messages.append({"role": "user", "content": f"Turn {turn}: plan a morning in {city}, then what?"})
        result = await chat(client, url, tenant, messages, args.turn_tokens, stream=True, t0=t0)
        result["turn"] = turn
        turns.append(result)
        messages.append({"role": "assistant", "content": result.get("text") or "ok"})
        await asyncio.sleep(args.think)
    return turns


async def batch(
    client: httpx.AsyncClient, url: str, tenant: str | None, count: int, tokens: int, t0: float, run: int, seed: int = 0
) -> list[dict]:
    return list(
        await asyncio.gather(
            *(
                chat(client, url, tenant, article_messages(i + seed, run), tokens, stream=False, t0=t0)
                for i in range(count)
            )
        )
    )


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(1800.0, connect=30.0),
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=2000),
        trust_env=False,
    )


async def delayed(seconds: float, job: Any) -> Any:
    await asyncio.sleep(seconds)
    return await job


def phase_figures(turns: list[dict], articles: list[dict]) -> dict[str, Any]:
    """One phase's figures: every turn's TTFT, the worst (no first token: inf), the batch's
    makespan, the requests that failed."""
    return {
        "turn_ttft_s": [t["ttft"] for t in turns],
        "worst_turn_s": max((t["ttft"] or float("inf") for t in turns), default=None),
        "makespan_s": max((a["done"] for a in articles), default=None),
        "failed": sum(1 for r in [*articles, *turns] if r["status"] != 200),
    }


async def chapter(gateway: str, engine: str, args: Any, run: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with new_client() as client:
        for phase, url, with_planner, with_batch in (
            ("planner_alone", gateway, True, False),
            ("batch_alone", gateway, False, True),
            ("both_direct", engine, True, True),
            ("both_gateway", gateway, True, True),
        ):
            t0 = time.perf_counter()
            started = time.time()  # the phase's start on the wall clock, to place the access log's lines (`ts`)
            via_gateway = url == gateway
            jobs = []
            if with_batch:
                jobs.append(
                    batch(
                        client,
                        url,
                        "articles" if via_gateway else None,
                        args.articles,
                        args.article_tokens,
                        t0,
                        run * 10 + len(out),
                    )
                )
            if with_planner:
                jobs.append(
                    delayed(
                        args.planner_delay if with_batch else 0.0,
                        planner(client, url, "planner" if via_gateway else None, args, t0),
                    )
                )
            stalls = StallWatch(client, gateway, engine, t0)
            await stalls.start()
            try:
                results = await asyncio.gather(*jobs)
            finally:
                seen = await stalls.stop()
            articles = results[0] if with_batch else []
            turns = results[-1] if with_planner else []
            figures = phase_figures(turns, articles)
            out[phase] = {"figures": figures, "requests": [*articles, *turns], "started": started, "stalls": seen}
            print(f"run {run} chapter {phase}: {json.dumps(figures)}", flush=True)
            await asyncio.sleep(2)
    a, b, d = (out[p]["figures"] for p in ("planner_alone", "batch_alone", "both_gateway"))
    out["goals"] = {
        "worst_turn_ratio": d["worst_turn_s"] / a["worst_turn_s"] if a["worst_turn_s"] else None,
        "makespan_ratio": d["makespan_s"] / b["makespan_s"] if b["makespan_s"] else None,
        "worst_turn_direct_ratio": out["both_direct"]["figures"]["worst_turn_s"] / a["worst_turn_s"]
        if a["worst_turn_s"]
        else None,
    }
    print(f"run {run} chapter goals: {json.dumps(out['goals'])}", flush=True)
    return out


# -- where a slow turn's time went -------------------------------------------------------------------

STALL_S = 0.25  # a wait this long or longer is counted as a stall


async def stalls_over(client: httpx.AsyncClient, url: str, name: str, le: str) -> float | None:
    """How many observations of histogram `name` at `url` exceed the bucket `le` (summed over
    label sets); None when the histogram or the page is missing."""
    try:
        buckets = await metric_values(client, url, name + "_bucket", timeout=30)
    except httpx.HTTPError:
        return None
    total = [value for labels, value in buckets.items() if 'le="+Inf"' in labels]
    within = sum(value for labels, value in buckets.items() if f'le="{le}"' in labels)
    return sum(total) - within if total else None


class StallWatch:
    """What stalled during one phase, told apart by where: vLLM's engine process (its own
    inter-token gaps, stamped in that process, over 0.3 s), vLLM's API server (an engine `/health`
    probe every 0.1 s: its time is that process's event loop), the gateway's event loop (its
    `gateway_event_loop_lag_seconds` over 0.25 s) and this load generator's own loop (the probe's
    sleep, late). Counts are the phase's, from the histograms before and after it."""

    GATEWAY = ("gateway_event_loop_lag_seconds", "0.25")
    ENGINE = ("vllm:inter_token_latency_seconds", "0.3")

    def __init__(self, client: httpx.AsyncClient, gateway: str, engine: str, t0: float) -> None:
        self.client, self.gateway, self.engine, self.t0 = client, gateway, engine, t0
        self.before: dict[str, float | None] = {}
        self.health = {"worst_s": 0.0, "at_s": None, "probes": 0, "over": 0}
        self.own = {"worst_late_s": 0.0, "at_s": None}
        self._task: asyncio.Task[None] | None = None

    async def counts(self) -> dict[str, float | None]:
        return {
            "gateway_loop": await stalls_over(self.client, self.gateway, *self.GATEWAY),
            "engine_itl": await stalls_over(self.client, self.engine, *self.ENGINE),
        }

    async def start(self) -> None:
        self.before = await self.counts()
        self._task = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            sent = time.perf_counter()
            try:
                await self.client.get(f"{self.engine}/health", timeout=60)
            except httpx.HTTPError:
                pass
            took = time.perf_counter() - sent
            self.health["probes"] += 1
            self.health["over"] += took >= STALL_S
            if took > self.health["worst_s"]:
                self.health.update(worst_s=took, at_s=sent - self.t0)
            asked = time.perf_counter() + 0.1
            await asyncio.sleep(0.1)
            late = time.perf_counter() - asked
            if late > self.own["worst_late_s"]:
                self.own.update(worst_late_s=late, at_s=asked - self.t0)

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        after = await self.counts()
        over = {
            name: (after[name] - before)
            if (before := self.before.get(name)) is not None and after[name] is not None
            else None
            for name in after
        }
        return {
            "gateway_loop_lags_over_0.25s": over["gateway_loop"],
            "engine_itl_gaps_over_0.3s": over["engine_itl"],
            "engine_health": self.health,
            "load_generator": self.own,
        }


def shares(results: list[dict], tenants: tuple[str, str], until: float) -> dict[str, Any]:
    """Each tenant's share of the tokens served by answers finished before `until`."""
    tokens = {t: sum(served_tokens(r) for r in results if r["tag"] == t and r["done"] <= until) for t in tenants}
    total = sum(tokens.values()) or 1
    return {"tokens": tokens, "share": {t: tokens[t] / total for t in tenants}, "window_s": until}


def started_at(result: dict[str, Any]) -> float | None:
    """When the engine began answering (its first token), from the run's start."""
    return result["sent"] + result["ttft"] if result.get("ttft") is not None else None


def tokens_within(result: dict[str, Any], a: float, b: float) -> float:
    """The served tokens of one streamed answer that fall in [a, b]: its uncached prompt at its
    first token, its output spread evenly from the first token to the end."""
    first = started_at(result)
    if first is None:
        return 0.0
    usage = result.get("usage") or {}
    prompt = served_tokens(result) - usage.get("completion_tokens", 0)
    out = float(prompt) if a <= first <= b else 0.0
    end = result["done"]
    span = end - first
    overlap = max(0.0, min(b, end) - max(a, first))
    return out + (usage.get("completion_tokens", 0) * overlap / span if span > 0 else 0.0)


def backlogged_shares(results: list[dict]) -> dict[str, Any]:
    """Each tenant's share of the tokens served while both were backlogged: from light's first
    answer starting (before it, light had not been served at all: heavy's requests sent first
    held every slot) to the earlier of the two tenants' last answer starting (after it, that
    tenant had nothing left waiting). Also the wait before light was first served."""
    starts = {
        t: sorted(s for r in results if r["tag"] == t and (s := started_at(r)) is not None) for t in ("heavy", "light")
    }
    if not starts["light"] or not starts["heavy"]:
        return {"share": {"heavy": None, "light": None}, "window_s": None}
    a = starts["light"][0]
    b = min(starts["heavy"][-1], starts["light"][-1])
    tokens = {t: sum(tokens_within(r, a, b) for r in results if r["tag"] == t) for t in ("heavy", "light")}
    total = sum(tokens.values())
    return {
        "tokens": tokens,
        "share": {t: tokens[t] / total if total > 0 and b > a else None for t in tokens},
        "window_s": [a, b],
        "light_first_served_s": a,
    }


def slot_shares(results: list[dict], first: int) -> dict[str, Any]:
    """Each tenant's share of the engine slots handed out while both had requests waiting: the
    requests started (first token) after the first `first` (those went in at once, before light's
    requests arrived: nothing preempts them), up to the last start of the tenant whose backlog
    ended first. Tokens: each request's served tokens (same shape for both)."""
    starts = [(started_at(r), r) for r in results]
    ranked = sorted(((s, r) for s, r in starts if s is not None), key=lambda pair: pair[0])
    waited = ranked[first:]
    last = {t: max((s for s, r in waited if r["tag"] == t), default=None) for t in ("heavy", "light")}
    if None in last.values():
        return {"slots": None, "share": {"heavy": None, "light": None}}
    end = min(v for v in last.values() if v is not None)
    slots = {t: sum(1 for s, r in waited if r["tag"] == t and s <= end) for t in ("heavy", "light")}
    tokens = {t: sum(served_tokens(r) for s, r in waited if r["tag"] == t and s <= end) for t in ("heavy", "light")}
    total = sum(tokens.values())
    return {"slots": slots, "tokens": tokens, "share": {t: tokens[t] / total if total else None for t in tokens}}


async def where(gateway: str, engine: str, args: Any, run: int) -> dict[str, Any]:
    """Where the planner's slow turns come from: the batch through the gateway in both phases, the
    planner through the gateway or straight to the engine (no `priority` field: vLLM's default, 0,
    the interactive class's own), each alone first. A slow turn that comes as often straight to
    the engine is the engine's (its steps, its API server, the shared cores), not the gateway's."""
    out: dict[str, Any] = {}
    async with new_client() as client:
        for phase, url, tenant, with_batch in (
            ("alone_gateway", gateway, "planner", False),
            ("alone_engine", engine, None, False),
            ("beside_gateway", gateway, "planner", True),
            ("beside_engine", engine, None, True),
        ):
            t0 = time.perf_counter()
            jobs = [delayed(args.planner_delay if with_batch else 0.0, planner(client, url, tenant, args, t0))]
            if with_batch:
                seed = run * 10 + 5 + len(out)
                jobs.append(batch(client, gateway, "articles", args.articles, args.article_tokens, t0, seed))
            results = await asyncio.gather(*jobs)
            turns, articles = results[0], (results[1] if with_batch else [])
            figures = phase_figures(turns, articles)
            out[phase] = {"figures": figures, "requests": [*articles, *turns]}
            print(f"run {run} where {phase}: {json.dumps(figures)}", flush=True)
            await asyncio.sleep(2)
    out["goals"] = {
        path: out[f"beside_{path}"]["figures"]["worst_turn_s"] / out[f"alone_{path}"]["figures"]["worst_turn_s"]
        for path in ("gateway", "engine")
    }
    print(f"run {run} where ratios: {json.dumps(out['goals'])}", flush=True)
    return out


async def fair(gateway: str, engine: str, args: Any, run: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with new_client() as client:
        for phase, url in (("gateway", gateway), ("direct", engine)):
            t0 = time.perf_counter()
            via = url == gateway
            heavy = [
                chat(
                    client,
                    url,
                    "heavy" if via else None,
                    article_messages(1000 + i, run),
                    args.fair_tokens,
                    stream=True,
                    t0=t0,
                )
                for i in range(args.light * 10)
            ]
            light = [
                chat(
                    client,
                    url,
                    "light" if via else None,
                    article_messages(5000 + i, run),
                    args.fair_tokens,
                    stream=True,
                    t0=t0,
                )
                for i in range(args.light)
            ]
            tasks = [asyncio.ensure_future(c) for c in heavy]
            await asyncio.sleep(0.05)  # heavy's backlog first, then light's
            tasks += [asyncio.ensure_future(c) for c in light]
            results = await asyncio.gather(*tasks)
            for i, r in enumerate(results):
                r["tag"] = "heavy" if i < len(heavy) else "light"
            figures = backlogged_shares(results)
            figures["slots"] = slot_shares(results, 32 if url == engine else 32 - 2)  # the gate's batch headroom: 2
            figures["median_latency_s"] = {
                t: median(r["done"] - r["sent"] for r in results if r["tag"] == t) for t in ("heavy", "light")
            }
            figures["median_ttft_s"] = {
                t: median(r["ttft"] for r in results if r["tag"] == t and r["ttft"] is not None)
                for t in ("heavy", "light")
            }
            figures["makespan_s"] = max(r["done"] for r in results)
            figures["failed"] = sum(1 for r in results if r["status"] != 200)
            out[phase] = {"figures": figures, "requests": results}
            print(f"run {run} fair {phase}: {json.dumps(figures)}", flush=True)
            await asyncio.sleep(2)
    return out


def unique_messages(i: int, run: int, length: int) -> list[dict[str, str]]:
    rng = random.Random(run * 100_000 + i)
    words = " ".join(rng.choice(CITIES).split()[0] + str(rng.randrange(1000)) for _ in range(length // 8))
    return [{"role": "system", "content": words[:length]}, {"role": "user", "content": f"Summarise item {i}."}]


def shared_messages(i: int, run: int, length: int) -> list[dict[str, str]]:
    common = unique_messages(-1, run, length)[0]["content"]  # one long prefix for every request
    return [common_system(common), {"role": "user", "content": f"Summarise item {i}."}]


def common_system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


async def metric_values(
    client: httpx.AsyncClient, url: str, name: str, timeout: Any = httpx.USE_CLIENT_DEFAULT
) -> dict[str, float]:
    """Every sample of `name` on `url`'s /metrics page, by its labels (`{...}`)."""
    text = (await client.get(f"{url}/metrics", timeout=timeout)).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


async def uncached(gateway: str, engine: str, args: Any, run: int) -> dict[str, Any]:
    async with new_client() as client:
        before = {
            "virtual": await metric_values(client, gateway, "gateway_flow_virtual_tokens"),
            "served": await metric_values(client, gateway, "gateway_flow_served_tokens_total"),
        }
        t0 = time.perf_counter()
        jobs = []
        for i in range(args.uncached_requests):
            for tenant, make in (("shared", shared_messages), ("unique", unique_messages)):
                jobs.append(
                    (tenant, chat(client, gateway, tenant, make(i, run, args.prompt_chars), 8, stream=False, t0=t0))
                )
        results = await asyncio.gather(*(job for _, job in jobs))
        for (tenant, _), r in zip(jobs, results, strict=True):
            r["tag"] = tenant
        first_done = min(max(r["done"] for r in results if r["tag"] == t) for t in ("shared", "unique"))
        served = {t: sum(1 for r in results if r["tag"] == t and r["done"] <= first_done) for t in ("shared", "unique")}
        after = {
            "virtual": await metric_values(client, gateway, "gateway_flow_virtual_tokens"),
            "served": await metric_values(client, gateway, "gateway_flow_served_tokens_total"),
        }
    figures = {
        "requests_served_while_both_backlogged": served,
        "window_s": first_done,
        "tokens": shares(results, ("shared", "unique"), first_done)["tokens"],
        "mean_prompt_tokens": {
            t: median((r.get("usage") or {}).get("prompt_tokens", 0) for r in results if r["tag"] == t)
            for t in ("shared", "unique")
        },
        "median_cached_tokens": {
            t: median(
                ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for r in results
                if r["tag"] == t
            )
            for t in ("shared", "unique")
        },
        "counters_before": before,
        "counters_after": after,
        "failed": sum(1 for r in results if r["status"] != 200),
    }
    print(f"run {run} uncached: {json.dumps(figures)}", flush=True)
    return {"figures": figures, "requests": results}


# -- processes --------------------------------------------------------------------------------------


async def every_worker_started(gateway: Started, workers: int, timeout: float = 300.0) -> None:
    """Until the gateway's supervisor says every worker serves (its start line names their pids).
    One worker has no supervisor and no such line: answering /v1/models was enough."""
    if workers <= 1:
        return
    deadline = time.monotonic() + timeout
    while "workers (pids" not in gateway.log.read_text(errors="replace"):
        if gateway.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's workers did not all start:\n{gateway.log_tail()}")
        await asyncio.sleep(0.5)


async def wait_ready(url: str, key: str | None, started: Started | None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while time.monotonic() < deadline:
            if started is not None and started.process.poll() is not None:
                raise RuntimeError(f"{started.name} exited:\n{started.log_tail()}")
            try:
                if (await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


async def main_async(args: Any) -> int:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    profile = load_profile(PROFILE)
    prepare(profile)
    port = free_port()
    engine = EngineSupervisor(profile, port=port, name=f"bench-fairness:{port}", max_restarts=0)
    procs = Processes()
    report: dict[str, Any] = {
        "commit": commit_of("HEAD"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": machine()["cpu"],
            "platform": platform.platform(),
            "load_before": os.getloadavg(),
        },
        "args": vars(args),
        "runs": [],
    }
    try:
        await engine.start()
        await engine.wait_ready()
        engine_url = engine.url
        print(f"engine ready at {engine_url}", flush=True)
        config = procs.log_dir / "fairness.gateway.json"
        config.write_text(json.dumps(gateway_config(engine_url, args.access_log)))
        gport = free_port()
        gateway = procs.start(
            "gateway",
            [PYTHON, "-m", "server", "serve", "--config", str(config), "--port", str(gport)]
            + ["--workers", str(args.workers)],
            core=None,
            env={"PYTHONPATH": str(ROOT)},
        )
        gateway_url = f"http://127.0.0.1:{gport}"
        await wait_ready(gateway_url, KEYS["planner"], gateway)
        await every_worker_started(gateway, args.workers)
        await wait_ready(engine_url, None, None)
        for run in range(args.runs):
            entry: dict[str, Any] = {"run": run, "load": os.getloadavg()}
            for scenario in args.scenarios.split(","):
                fn = {"chapter": chapter, "fair": fair, "uncached": uncached, "where": where}[scenario]
                entry[scenario] = await fn(gateway_url, engine_url, args, run)
                write(report | {"runs": [*report["runs"], entry]}, output)
            report["runs"].append(entry)
            write(report, output)
    finally:
        procs.close()
        await engine.stop()
        if args.access_log:
            keep_access_log(procs.log_dir / "gateway.log", output / "access.jsonl")
    return 0


def keep_access_log(log: Path, out: Path) -> None:
    """The gateway's access-log lines (one JSON object a request), in order, from its whole log."""
    if not log.exists():
        print(f"no gateway log at {log}: access.jsonl not written", flush=True)
        return
    kept = ('"logger":"gateway.access"', '"logger":"gateway.loop"')  # each request, and each stall of its loop
    lines = [line for line in log.read_text(errors="replace").splitlines() if any(k in line for k in kept)]
    out.write_text("".join(line + "\n" for line in lines))
    print(f"{len(lines)} access-log lines: {out}", flush=True)


def stat(values: list[Any], digits: int = 2) -> str:
    """`median (min..max, n runs)` of the known values."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    return f"{median(known):.{digits}f} ({min(known):.{digits}f}..{max(known):.{digits}f}, {len(known)} runs)"


def row(label: str, *cells: str) -> str:
    return "| " + " | ".join((label, *cells)) + " |"


def chapter_lines(chapters: list[dict[str, Any]]) -> list[str]:
    def fig(phase: str, name: str) -> list[Any]:
        return [c[phase]["figures"][name] for c in chapters]

    def goal(name: str) -> list[Any]:
        return [c["goals"][name] for c in chapters]

    lines = ["## The chapter's two workloads", "", row("figure", "value"), row("---", "---")]
    for phase in ("planner_alone", "both_direct", "both_gateway"):
        lines.append(row(f"worst turn TTFT, {phase} (s)", stat(fig(phase, "worst_turn_s"))))
    for phase in ("batch_alone", "both_direct", "both_gateway"):
        lines.append(row(f"batch makespan, {phase} (s)", stat(fig(phase, "makespan_s"), 1)))
    lines.append(row("worst turn beside the batch / alone, gateway (goal <= 3)", stat(goal("worst_turn_ratio"))))
    lines.append(row("worst turn beside the batch / alone, direct FCFS", stat(goal("worst_turn_direct_ratio"))))
    lines.append(row("batch makespan beside the planner / alone (goal <= 1.2)", stat(goal("makespan_ratio"))))
    phases = ("planner_alone", "batch_alone", "both_direct", "both_gateway")
    failed = sum(c[p]["figures"]["failed"] for c in chapters for p in phases)
    lines += [row("failed requests (all phases, all runs)", str(failed)), "", "Every turn's TTFT (s):", ""]
    lines += [*every_turn(chapters, ("planner_alone", "both_direct", "both_gateway")), ""]
    return [*lines, *stall_lines(chapters)]


def stall_lines(chapters: list[dict[str, Any]]) -> list[str]:
    """Per run, with the planner beside the batch through the gateway: its worst turn, and what
    stalled meanwhile and where (StallWatch)."""
    runs = [(i, c["both_gateway"]) for i, c in enumerate(chapters) if "stalls" in c["both_gateway"]]
    if not runs:
        return []
    lines = [
        "Where a stall was, with the planner beside the batch through the gateway (StallWatch: vLLM's own "
        "inter-token gaps over 0.3 s, the worst of an engine `/health` probe every 0.1 s, the gateway's "
        "event-loop lags over 0.25 s, this load generator's own loop):",
        "",
        row(
            "run",
            "worst turn (s)",
            "vLLM ITL gaps > 0.3 s",
            "engine /health worst (s, at)",
            "gateway loop lags > 0.25 s",
            "load generator late (s, at)",
        ),
        row("---", "---", "---", "---", "---", "---"),
    ]
    for i, phase in runs:
        st = phase["stalls"]
        health, own = st["engine_health"], st["load_generator"]
        worst = phase["figures"]["worst_turn_s"]
        slow = max(phase["requests"], key=lambda r: r.get("ttft") or 0.0) if phase["requests"] else None
        lines.append(
            row(
                str(i),
                f"{worst:.3f}" + (f" (sent at {slow['sent']:.1f} s)" if slow else ""),
                f"{st['engine_itl_gaps_over_0.3s']}",
                f"{health['worst_s']:.3f} at {health['at_s'] or 0:.1f} s"
                f" ({health['over']} of {health['probes']} over 0.25 s)",
                f"{st['gateway_loop_lags_over_0.25s']}",
                f"{own['worst_late_s']:.3f} at {own['at_s'] or 0:.1f} s",
            )
        )
    return [*lines, ""]


def every_turn(runs: list[dict[str, Any]], phases: tuple[str, ...]) -> list[str]:
    """A line per run and phase: each turn's TTFT (-: no first token)."""
    lines = []
    for i, scenario in enumerate(runs):
        for phase in phases:
            ttfts = ", ".join(f"{t:.2f}" if t is not None else "-" for t in scenario[phase]["figures"]["turn_ttft_s"])
            lines.append(f"- run {i} {phase}: {ttfts}")
    return lines


def slot_share(figures: dict[str, Any], tenant: str) -> float | None:
    """`slot_shares` of a fair phase, from its requests when the run predates the figure."""
    return figures["slots"]["share"][tenant] if "slots" in figures else None


def fair_lines(fairs: list[dict[str, Any]]) -> list[str]:
    def both(get: Any, digits: int = 2) -> tuple[str, str]:
        return stat([get(f["gateway"]["figures"]) for f in fairs], digits), stat(
            [get(f["direct"]["figures"]) for f in fairs], digits
        )

    lines = ["## Two batch tenants, heavy sends 10x light", "", row("figure", "gateway", "direct (FCFS)")]
    lines.append(row("---", "---", "---"))
    for tenant in ("light", "heavy"):
        lines.append(
            row(f"{tenant}'s share of served tokens while both backlogged", *both(lambda f, t=tenant: f["share"][t]))
        )
        lines.append(row(f"{tenant}'s median latency (s)", *both(lambda f, t=tenant: f["median_latency_s"][t], 1)))
        lines.append(row(f"{tenant}'s median TTFT (s)", *both(lambda f, t=tenant: f["median_ttft_s"][t], 1)))
    lines.append(row("light first served after (s)", *both(lambda f: f.get("light_first_served_s"), 1)))
    for tenant in ("light", "heavy"):
        lines.append(
            row(
                f"{tenant}'s share of the slots handed out while both waited (slot_shares)",
                *both(lambda f, t=tenant: slot_share(f, t)),
            )
        )
    lines.append(row("makespan (s)", *both(lambda f: f["makespan_s"], 1)))
    failed = sum(f[p]["figures"]["failed"] for f in fairs for p in ("gateway", "direct"))
    return [*lines, row("failed", str(failed), ""), ""]


def where_lines(wheres: list[dict[str, Any]]) -> list[str]:
    phases = ("alone_gateway", "alone_engine", "beside_gateway", "beside_engine")
    lines = [
        "## Where the slow turns come from (the batch through the gateway; the planner through it or not)",
        "",
        row("figure", "planner through the gateway", "planner straight to the engine"),
        row("---", "---", "---"),
    ]
    for what in ("alone", "beside"):
        cells = (
            stat([w[f"{what}_{path}"]["figures"]["worst_turn_s"] for w in wheres]) for path in ("gateway", "engine")
        )
        lines.append(row(f"worst turn TTFT, {what} (s)", *cells))
    lines.append(
        row(
            "worst turn beside the batch / alone",
            *(stat([w["goals"][p] for w in wheres]) for p in ("gateway", "engine")),
        )
    )
    slow = [
        stat(
            [sum(1 for t in w[f"beside_{path}"]["figures"]["turn_ttft_s"] if t is None or t > 0.25) for w in wheres], 0
        )
        for path in ("gateway", "engine")
    ]
    lines.append(row("turns beside the batch slower than 0.25 s", *slow))
    lines.append(
        row(
            "batch makespan (s)",
            *(stat([w[f"beside_{p}"]["figures"]["makespan_s"] for w in wheres], 1) for p in ("gateway", "engine")),
        )
    )
    failed = sum(w[p]["figures"]["failed"] for w in wheres for p in phases)
    lines += [row("failed requests (all phases, all runs)", str(failed), ""), "", "Every turn's TTFT (s):", ""]
    return [*lines, *every_turn(wheres, phases), ""]


def uncached_lines(uncacheds: list[dict[str, Any]]) -> list[str]:
    figs = [u["figures"] for u in uncacheds]

    def pair(name: str) -> tuple[str, str]:
        return stat([f[name]["shared"] for f in figs], 0), stat([f[name]["unique"] for f in figs], 0)

    lines = [
        "## Uncached-token charging",
        "",
        row("figure", "shared prefix", "unique prompts"),
        row("---", "---", "---"),
    ]
    lines.append(row("requests served while both backlogged", *pair("requests_served_while_both_backlogged")))
    lines.append(row("median prompt tokens", *pair("mean_prompt_tokens")))
    lines.append(row("median cached tokens", *pair("median_cached_tokens")))
    lines.append(row("tokens served in that window (uncached prompt + output)", *pair("tokens")))
    lines += ["", "Gateway counters after each run (virtual tokens; served tokens):", ""]
    for i, f in enumerate(figs):
        after = f["counters_after"]
        lines.append(f"- run {i}: {json.dumps(after['virtual'])}; {json.dumps(after['served'])}")
    return [*lines, ""]


def summary(report: dict[str, Any]) -> str:
    """Median and range over the runs of every headline figure."""
    runs = report["runs"]
    load = ", ".join(f"{x:.1f}" for x in report["machine"]["load_before"])
    cpu = report["machine"].get("cpu", "model not recorded")
    lines = [
        "# Issue 32: priority classes and fair queueing on a real vLLM engine",
        "",
        f"Commit {report['commit']}; {report['machine']['cpus']} CPUs ({cpu}), "
        f"load average before: {load}. Engine: configs/profiles/tiny-cpu-priority.yaml (max-num-seqs 32).",
        f"Arguments: `{json.dumps(report['args'])}`. Each figure: median (min..max, runs); raw data: fairness.json.",
        "",
    ]
    renders = (("chapter", chapter_lines), ("fair", fair_lines), ("uncached", uncached_lines), ("where", where_lines))
    for name, render in renders:
        done = [r[name] for r in runs if name in r]
        if done:
            lines += render(done)
    return "\n".join(lines)


def write(report: dict[str, Any], output: Path) -> None:
    (output / "fairness.json").write_text(json.dumps(report, indent=1))
    (output / "fairness.md").write_text(summary(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default="docs/bench/fairness")
    parser.add_argument("--scenarios", default="chapter,fair,uncached")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--think", type=float, default=0.3, help="seconds between the planner's turns")
    parser.add_argument("--planner-delay", type=float, default=3.0)
    parser.add_argument("--articles", type=int, default=100)
    parser.add_argument("--article-tokens", type=int, default=128)
    parser.add_argument("--light", type=int, default=12, help="light's requests (heavy sends 10x)")
    parser.add_argument("--fair-tokens", type=int, default=32)
    parser.add_argument("--uncached-requests", type=int, default=40, help="per tenant")
    parser.add_argument("--prompt-chars", type=int, default=1200)
    parser.add_argument(
        "--workers", type=int, default=1, help="the gateway's workers (each queues its own requests: issue 32 item 5)"
    )
    parser.add_argument(
        "--access-log",
        action="store_true",
        help="the gateway writes its access log (each request's class, gate wait, TTFT); kept as OUTPUT/access.jsonl",
    )
    parser.add_argument("--render", help="re-render OUTPUT/fairness.md from this fairness.json (figures added since)")
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        for entry in report["runs"]:
            for phase, first in (("gateway", 30), ("direct", 32)):
                data = entry.get("fair", {}).get(phase)
                if data is not None:
                    data["figures"]["slots"] = slot_shares(data["requests"], first)
        write(report, Path(args.output))
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
