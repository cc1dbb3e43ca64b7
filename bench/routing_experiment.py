"""The cache-aware routing experiment: two real tiny replicas, one gateway, a multi-tenant workload
with cache pressure, sent once per routing policy; how much of the prompts the engines' prefix
caches served, the time to first token, and how the requests were split.

The engines are started once, by the project's own supervisor (server.engine.supervisor), from a
gateway config (default configs/gateway.routing.yaml: the tiny-cpu-routing profile, two replicas
with 48 KV blocks of 128 tokens each and KV events). Then, for each policy in turn: every
engine's prefix cache is emptied (POST /reset_prefix_cache), a gateway is started with that
policy (`python -m server serve`, the same config with only `routing:` changed), the workload
(loadtest.tenants) is sent through it by `--concurrency` simulated users (loadtest.client), and
the gateway is stopped. The policies:

- `round_robin`: each replica in turn (prefix affinity off).
- `today`: the gateway's default before cache-aware routing: least outstanding after a prefix-key
  affinity (rendezvous hashing of the prompt's first 1,024 characters).
- `approximate`, `precise`: `cache_aware` with the approximate or the precise (KV events) index.
- `router_cache_aware`, `router_kv_aware`: no gateway; vllm-router (the Rust router of the vLLM
  project, installed beside the gateway) with `--policy cache_aware` (its approximate tree and
  load thresholds, defaults) or `--policy kv_aware` (fed by the engines' own KV events,
  `--kv-event-source`, block size 128), in front of the same replicas.
- `oracle`: no gateway. The load tester sends tenant t straight to replica t mod 2: the tenants
  split evenly, every conversation of a tenant on one replica.
- `--weights balance=0` and the like add a `precise` run with those scorer weights.

Every policy runs on every workload of `--workloads` (bench.routing_workloads: `tenants`, the
experiment's own, and `hot-prefix`, issue 34's: 24 tenants opening with the same house rules,
single-turn questions, shuffled, two at a time), workload after workload within a round.

Per policy: the cached share of prompt tokens (usage.prompt_tokens_details.cached_tokens summed
over prompt tokens), cross-checked with the engines' vllm:prefix_cache_hits_total /
queries_total deltas; TTFT p50/p90; requests per replica (vllm:request_success_total deltas);
the gateway's routing reasons (its access log); the engines' own queue, prefill and first-token
seconds per replica. `--rounds N` repeats the whole list with the same engines, for side-by-side
ratios on a noisy machine. Writes report.md, summary.json, command.txt and requests.jsonl.gz
(every request: when it left, its TTFT, its prompt and cached tokens, its tenant, the replica
that served it and the gateway's routing decision, joined by request id) into `--output`. Every
process it started is stopped on any exit (Ctrl-C too).

python -m bench.routing_experiment --help
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import logging
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.procs import PYTHON, Processes, Started, commit_of, free_port, gateway_code
from bench.routing_workloads import WORKLOADS, WorkloadSpec, ordered_sessions
from loadtest.client import ChatClient, make_http_client
from loadtest.metrics import percentile
from loadtest.records import RequestRecord
from loadtest.scenarios import Session
from loadtest.tenants import Workload, tenant_of
from server.config import read_mapping
from server.deploy.plan import DeploymentPlan, plan_deployment
from server.engine.render import local_kv_events_port
from server.engine.supervisor import EngineSupervisor, prepare
from server.gateway.replicas.scoring import Weights
from server.gateway.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "gateway.routing.yaml"
DEFAULT_OUTPUT = ROOT / "loadtest" / "results" / "cache-aware-routing"
ORACLE = "oracle"
# Each policy's `routing:` section (merged over the config's). `today` is the default before the
# cache-aware issue: policy least_outstanding after the prefix-key affinity (prefix_chars 1,024).
POLICIES: dict[str, dict[str, Any] | None] = {
    "round_robin": {"policy": "round_robin", "prefix_affinity": False},
    "today": {"policy": "least_outstanding", "prefix_affinity": True, "prefix_chars": 1024},
    "approximate": {"policy": "cache_aware", "prefix_index": "approximate"},
    "precise": {"policy": "cache_aware", "prefix_index": "precise"},
    "router_cache_aware": None,
    "router_kv_aware": None,
    ORACLE: None,
}
CACHE_AWARE = ("approximate", "precise")
ROUTERS = {"router_cache_aware": "cache_aware", "router_kv_aware": "kv_aware"}  # phase -> vllm-router --policy
DEFAULT_POLICIES = ("round_robin", "approximate", "precise", "router_cache_aware", "router_kv_aware", ORACLE)
VLLM_ROUTER = str(Path(PYTHON).with_name("vllm-router"))
KV_EVENT_BLOCK_SIZE = 128  # the routing profile's block size

log = logging.getLogger("routing_experiment")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the phases to run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One policy (or weight variant) to measure: its label and the gateway's `routing:` section."""

    label: str
    base: str  # one of POLICIES
    routing: dict[str, Any] | None  # None: the oracle (no gateway)
    code: str | None = None  # the gateway of this commit instead of --code's (`--before`)


def parse_weights(text: str) -> dict[str, float]:
    """`balance=0,prefix=2` -> {"balance": 0.0, "prefix": 2.0}, checked against the scorers."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: give NAME=NUMBER") from None
    try:
        Weights(**out)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return out


def phases(
    policies: list[str], weights: list[dict[str, float]], weights_index: str, before: str | None = None
) -> list[Phase]:
    """Each policy; with `before`, each cache-aware one again with that commit's gateway, beside it."""
    out = []
    for p in policies:
        out.append(Phase(p, p, POLICIES[p]))
        if before and p in CACHE_AWARE:
            out.append(Phase(f"{p}@{before}", p, POLICIES[p], code=before))
    defaults = Weights().model_dump()
    for variant in weights:
        label = f"{weights_index}[{','.join(f'{k}={v:g}' for k, v in variant.items())}]"
        routing = {**(POLICIES[weights_index] or {}), "weights": {**defaults, **variant}}
        out.append(Phase(label, weights_index, routing))
    return out


# -- configs and processes ---------------------------------------------------------------------


def derived_config(config: Path, directory: Path, name: str, routing: dict[str, Any] | None, **top: Any) -> Path:
    """`config` with absolute profile paths, `routing` merged over its own, written to `directory`."""
    data = read_mapping(config)
    for model in data.get("models", []):
        if model.get("profile") and not Path(model["profile"]).is_absolute():
            model["profile"] = str((config.parent / model["profile"]).resolve())
        if top.get("base_port") is not None:
            model["base_port"] = top["base_port"]
        if top.get("trimming") is not None:
            model["trimming"] = {"mode": top["trimming"]}
    if routing is not None:
        data["routing"] = {**data.get("routing", {}), **routing}
    data.update({k: v for k, v in top.items() if k not in ("base_port", "trimming") and v is not None})
    path = directory / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def start_engines(plan: DeploymentPlan, *, pin: bool = False) -> list[EngineSupervisor]:
    """The plan's engines, supervised, ready (the same supervisor `python -m server up` uses).

    With `pin`, replica i runs on core i (mod the cores): the replicas are separate compute, as two
    GPUs are. Unpinned, two replicas on a shared CPU share its cores, so one replica doing all the
    work loses no compute and a policy that piles every request onto one replica is not punished
    in TTFT. The affinity is set as soon as the API server process exists, before it starts its
    engine-core process and threads, which inherit it (and size their thread pools by it)."""
    for model in plan.models:
        if model.profile is not None:
            prepare(model.profile)
    supervisors = [
        EngineSupervisor(e.profile, host=e.host, port=e.port, name=f"{e.model}:{e.port}", max_restarts=0)
        for e in plan.engines
    ]
    try:
        cores = sorted(os.sched_getaffinity(0))
        for index, supervisor in enumerate(supervisors):
            await supervisor.start()
            if pin and supervisor.pid is not None:
                core = cores[index % len(cores)]
                os.sched_setaffinity(supervisor.pid, {core})
                say(f"engine {supervisor.name} pinned to core {core}")
        started = time.perf_counter()
        waits = [asyncio.ensure_future(s.wait_ready()) for s in supervisors]
        while not all(w.done() for w in waits):
            await asyncio.wait(waits, timeout=15)
            ready = sum(w.done() for w in waits)
            say(f"engines: {ready}/{len(waits)} ready after {time.perf_counter() - started:.0f} s")
            for wait in waits:
                if wait.done():
                    wait.result()  # raises EngineStartError
        return supervisors
    except BaseException:
        await stop_engines(supervisors)
        raise


async def stop_engines(supervisors: list[EngineSupervisor]) -> None:
    if supervisors:
        say(f"stopping {len(supervisors)} engine(s)")
        await asyncio.gather(*(s.stop() for s in supervisors), return_exceptions=True)


async def wait_gateway(started: Started, url: str, engines: list[str], *, events: bool, timeout: float) -> None:
    """Until the gateway is ready (and, for the precise index, receives every engine's events)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if started.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {started.process.returncode}:\n{started.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/ready")).status_code == 200:
                    if not events:
                        return
                    text = (await client.get(f"{url}/metrics")).text
                    up = metric_values(text, "gateway_engine_kv_events_up")
                    if len(up) >= len(engines) and all(v == 1.0 for v in up.values()):
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the gateway was not ready within {timeout:.0f} s:\n{started.log_tail()}")


async def stop_gateway(processes: Processes, started: Started) -> None:
    await asyncio.to_thread(processes.stop, started, 30.0)


def router_argv(policy: str, port: int, engines: list[str], model_path: str | None = None) -> list[str]:
    """vllm-router with `policy` in front of `engines`; kv_aware subscribes to their KV events."""
    argv = [
        VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines, "--policy", policy,
        "--log-level", "warning", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    if policy == "kv_aware":
        for url in engines:
            events = local_kv_events_port(int(url.rsplit(":", 1)[1]))
            argv += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        argv += ["--kv-event-block-size", str(KV_EVENT_BLOCK_SIZE)]
        if model_path is not None:  # the model identity its static event sources require, and its tokenizer
            argv += ["--kv-event-model", model_path]
    return argv


async def wait_router(started: Started, url: str, *, timeout: float) -> None:
    """Until vllm-router lists the model (it has checked its workers); no chat request, which would
    leave blocks in a cache that was just emptied."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if started.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {started.process.returncode}:\n{started.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                response = await client.get(f"{url}/v1/models")
                if response.status_code == 200 and response.json().get("data"):
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"vllm-router was not ready within {timeout:.0f} s:\n{started.log_tail()}")


# -- engine metrics ----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_values(text: str, name: str) -> dict[str, float]:
    """Every sample of metric `name` in a Prometheus text page: labels text -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            with contextlib.suppress(ValueError):
                out[match.group(2) or ""] = float(match.group(3))
    return out


ENGINE_COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "requests": "vllm:request_success_total",
    # The engine's own time split of its requests (sums of seconds, and how many): waiting in its
    # queue, then prefilling; its TTFT. Per phase and replica they say where a slow TTFT came from.
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "queued": "vllm:request_queue_time_seconds_count",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "prefilled": "vllm:request_prefill_time_seconds_count",
    "ttft_s": "vllm:time_to_first_token_seconds_sum",
    "ttfts": "vllm:time_to_first_token_seconds_count",
}
ENGINE_TIMES = ("queue_s", "queued", "prefill_s", "prefilled", "ttft_s", "ttfts")


async def engine_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    return {key: sum(metric_values(text, name).values()) for key, name in ENGINE_COUNTERS.items()}


async def reset_prefix_caches(client: httpx.AsyncClient, urls: list[str]) -> None:
    for url in urls:
        response = await client.post(f"{url}/reset_prefix_cache")
        if response.status_code != 200:
            raise RuntimeError(f"{url}/reset_prefix_cache answered {response.status_code}: {response.text[:200]}")


# -- the workload ------------------------------------------------------------------------------


async def send_workload(
    conversations: list[Session], route: dict[int, str], *, model: str, concurrency: int, timeout: float, label: str
) -> list[RequestRecord]:
    """Every conversation, `concurrency` at a time, turns in order; tenant t goes to `route[t]`."""
    http = make_http_client(max_connections=concurrency * 2, timeout_s=timeout)
    clients = {
        url: ChatClient(url, http=http, model=model, timeout_s=timeout, extra_body={"temperature": 0})
        for url in set(route.values())
    }
    queue = list(reversed(conversations))
    records: list[RequestRecord] = []
    origin = time.perf_counter()
    total = sum(len(s.turns) for s in conversations)
    last_report = [origin]

    async def user() -> None:
        while queue:
            session = queue.pop()
            client = clients[route[tenant_of(session)]]
            messages = list(session.prefix)
            for turn, (message, max_tokens) in enumerate(zip(session.turns, session.max_tokens, strict=True)):
                messages.append(message)
                record = RequestRecord(
                    f"{_slug(label)}-{session.id}-{turn}",
                    run=label,
                    session_id=session.id,
                    turn=turn,
                    max_tokens=max_tokens,
                )
                answer = await client.stream(record, messages, origin=origin)
                records.append(record)
                if not record.ok:
                    break  # the rest of this conversation would carry a broken history
                messages.append({"role": "assistant", "content": answer.text})
                now = time.perf_counter()
                if now - last_report[0] >= 15:
                    last_report[0] = now
                    say(f"  {label}: {len(records)}/{total} requests, {now - origin:.0f} s")

    try:
        await asyncio.gather(*(user() for _ in range(concurrency)))
    finally:
        await http.aclose()
    return records


# -- one phase ---------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    label: str
    base: str
    round: int
    workload: str = "tenants"
    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine_hits: float = 0.0
    engine_queries: float = 0.0
    ttft_p50_s: float = float("nan")
    ttft_p90_s: float = float("nan")
    split: dict[str, int] = field(default_factory=dict)  # engine URL -> requests it finished
    engine_times: dict[str, dict[str, float]] = field(default_factory=dict)  # engine URL -> ENGINE_TIMES deltas
    reasons: dict[str, int] = field(default_factory=dict)  # the gateway's routing reasons
    sources: dict[str, int] = field(default_factory=dict)  # precise / approximate / none
    seconds: float = 0.0
    gateway_cpu_s: float = float("nan")  # CPU seconds the gateway (or vllm-router) process used sending the workload
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)  # per request: requests.jsonl

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def engine_share(self) -> float:
        return self.engine_hits / self.engine_queries if self.engine_queries else float("nan")

    @property
    def imbalance(self) -> float:
        """Most requests on one replica over fewest (inf when a replica got none)."""
        counts = list(self.split.values())
        if not counts or max(counts) == 0:
            return float("nan")
        return max(counts) / min(counts) if min(counts) else float("inf")

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "rows"}
        data.update(cached_share=self.cached_share, engine_share=self.engine_share, imbalance=self.imbalance)
        return data


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` and its waited-for children (/proc; NaN elsewhere):
    the gateway shares the cores with the pinned engines, so what it spends, they lose."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    ticks = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def routing_decisions(log: Path) -> dict[str, dict[str, Any]]:
    """The gateway access log's routing decision of each request, by request id."""
    out: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"routing"' not in line:
            continue
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            routing = entry.get("routing")
            if isinstance(routing, dict) and entry.get("request_id"):
                out[str(entry["request_id"])] = routing
    return out


def request_rows(
    records: list[RequestRecord],
    tenants: dict[str, int],
    decisions: dict[str, dict[str, Any]],
    route: dict[int, str],
    engines: list[str],
) -> list[dict[str, Any]]:
    """One row per request for requests.jsonl: when it left, its TTFT, its prompt and cached tokens,
    its tenant and the replica that served it (the gateway's decision, or the oracle's route)."""
    rows = []
    for record in records:
        tenant = tenants.get(record.session_id or "")
        decision = decisions.get(record.request_id)
        engine = decision.get("engine") if decision else None
        if engine is None and tenant is not None and route.get(tenant) in engines:
            engine = route[tenant].split("://", 1)[-1]  # the oracle sent it there itself (as the gateway's id)
        rows.append(
            {
                "request_id": record.request_id,
                "tenant": tenant,
                "sent_s": round(record.sent_s, 4),
                "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4),
                "end_s": round(record.end_s, 4),
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "error": record.error_kind,
                "engine": engine,
                "routing": decision,
            }
        )
    return rows


def routing_counts(log: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The gateway access log's routing reasons and prefix-match sources."""
    reasons: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if '"routing"' not in line:
            continue
        with contextlib.suppress(ValueError):
            routing = json.loads(line).get("routing") or {}
            if isinstance(routing, dict) and routing.get("reason"):
                reasons[routing["reason"]] += 1
                sources[routing.get("source", "none")] += 1
    return dict(reasons), dict(sources)


async def run_phase(
    phase: Phase, round_: int, *, args: argparse.Namespace, config: Path, workdir: Path, processes: Processes,
    engines: list[str], model: str, conversations: list[Session], code: Path | dict[str | None, Path],
    workload: str = "tenants",
    concurrency: int = 4,
) -> PhaseResult:  # fmt: skip
    label = f"{workload}: {phase.label} (round {round_})"
    if isinstance(code, dict):
        code = code[phase.code]
    result = PhaseResult(phase.label, phase.base, round_, workload=workload)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as admin:
        await reset_prefix_caches(admin, engines)
        before = {url: await engine_counters(admin, url) for url in engines}
        gateway: Started | None = None
        tenants = sorted({tenant_of(s) for s in conversations})
        try:
            if phase.base in ROUTERS:
                port = free_port()
                model_path = getattr(args, "model_path", None)
                gateway = processes.start(
                    f"vllm-router-{_slug(workload)}-{_slug(phase.label)}-{round_}",
                    router_argv(ROUTERS[phase.base], port, engines, model_path), core=None,
                    env={"VLLM_ROUTER_TOKENIZER": model_path} if model_path else None,
                )  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                await wait_router(gateway, url, timeout=120)
                route = dict.fromkeys(tenants, url)
            elif phase.routing is None:
                route = {t: engines[t % len(engines)] for t in tenants}
            else:
                port = free_port()
                path = derived_config(
                    config, workdir, f"{_slug(workload)}-{_slug(phase.label)}-{round_}", phase.routing, port=port,
                    host="127.0.0.1", metrics_scrape_interval=getattr(args, "scrape_interval", None),
                )  # fmt: skip
                gateway = processes.start(
                    f"gateway-{_slug(workload)}-{_slug(phase.label)}-{round_}",
                    [PYTHON, "-P", "-m", "server", "serve", "--config", str(path)],
                    core=None, env={"PYTHONPATH": str(code)},
                )  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                events = phase.routing.get("policy") == "cache_aware" and phase.routing.get("prefix_index") == "precise"
                await wait_gateway(gateway, url, engines, events=events, timeout=120)
                route = dict.fromkeys(tenants, url)
            say(f"{label}: sending {sum(len(s.turns) for s in conversations)} requests")
            cpu_before = process_cpu_seconds(gateway.pid) if gateway is not None else 0.0
            started = time.perf_counter()
            records = await send_workload(
                conversations, route, model=model, concurrency=concurrency, timeout=args.timeout, label=label
            )
            result.seconds = time.perf_counter() - started
            if gateway is not None:
                result.gateway_cpu_s = process_cpu_seconds(gateway.pid) - cpu_before
        finally:
            if gateway is not None:
                await stop_gateway(processes, gateway)
        after = {url: await engine_counters(admin, url) for url in engines}
    ok = [r for r in records if r.ok]
    result.requests = len(records)
    result.failed = len(records) - len(ok)
    result.errors = sorted({r.error or "" for r in records if not r.ok})[:5]
    result.prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    result.cached_tokens = sum(r.cached_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    result.ttft_p50_s, result.ttft_p90_s = percentile(ttfts, 50), percentile(ttfts, 90)
    result.engine_hits = sum(after[u]["hits"] - before[u]["hits"] for u in engines)
    result.engine_queries = sum(after[u]["queries"] - before[u]["queries"] for u in engines)
    result.split = {u: round(after[u]["requests"] - before[u]["requests"]) for u in engines}
    result.engine_times = {u: {k: after[u][k] - before[u][k] for k in ENGINE_TIMES} for u in engines}
    decisions: dict[str, dict[str, Any]] = {}
    if gateway is not None and phase.base not in ROUTERS:
        result.reasons, result.sources = routing_counts(gateway.log)
        decisions = routing_decisions(gateway.log)
    result.rows = request_rows(records, {s.id: tenant_of(s) for s in conversations}, decisions, route, engines)
    say(
        f"{label}: cached share {result.cached_share:.3f} (engines {result.engine_share:.3f}), "
        f"TTFT p50 {result.ttft_p50_s * 1000:.0f} ms p90 {result.ttft_p90_s * 1000:.0f} ms, "
        f"split {list(result.split.values())}, failed {result.failed}, {result.seconds:.0f} s, "
        f"gateway CPU {result.gateway_cpu_s:.2f} s"
    )
    return result


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-")


# -- the report --------------------------------------------------------------------------------


def hit_share(result: PhaseResult) -> float:
    """The engines' own prefix-cache hits over queries (tokens), else the answers' cached_tokens."""
    share = result.engine_share
    return share if share == share else result.cached_share  # NaN: no counters


def judge(results: list[PhaseResult]) -> dict[str, dict[str, Any]]:
    """Per workload, round and cache-aware phase, issue 34's goals against that round's baselines:
    hit share >= the best vllm-router policy's and >= 0.9x the oracle's, requests per replica
    within 1.5x, TTFT p90 no worse than round robin's."""
    out: dict[str, dict[str, Any]] = {}
    for workload, round_ in sorted({(r.workload, r.round) for r in results}):
        by = {r.label: r for r in results if r.round == round_ and r.workload == workload}
        oracle, rr = by.get(ORACLE), by.get("round_robin")
        routers = [r for r in by.values() if r.base in ROUTERS]
        best_router = max(routers, key=hit_share, default=None)
        for result in by.values():
            if result.base not in CACHE_AWARE:
                continue
            share = hit_share(result)
            goals: dict[str, Any] = {"hit_share": share, "imbalance": result.imbalance}
            goals["imbalance_at_most_1.5"] = result.imbalance <= 1.5
            if oracle is not None:
                goals["share_vs_oracle"] = share / hit_share(oracle)
                goals["share_at_least_0.9_oracle"] = share >= 0.9 * hit_share(oracle)
            if best_router is not None:
                goals["best_router"] = best_router.label
                goals["share_vs_best_router"] = share / hit_share(best_router)
                goals["share_at_least_best_router"] = share >= hit_share(best_router)
            if rr is not None:
                goals["ttft_p90_vs_round_robin"] = result.ttft_p90_s / rr.ttft_p90_s
                goals["ttft_p90_no_worse_than_round_robin"] = result.ttft_p90_s <= rr.ttft_p90_s
                goals["share_above_round_robin"] = share > hit_share(rr)
            out[f"{workload}: {result.label} (round {round_})"] = goals
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(v for v in values if v == v)
    if not ordered:
        return float("nan")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def medians(results: list[PhaseResult]) -> list[dict[str, Any]]:
    """Per workload and policy, over every round: median and range of each figure."""
    out = []
    for workload, label in dict.fromkeys((r.workload, r.label) for r in results):
        runs = [r for r in results if r.workload == workload and r.label == label]
        row: dict[str, Any] = {"workload": workload, "label": label, "runs": len(runs)}
        for name, values in (
            ("hit_share", [hit_share(r) for r in runs]),
            ("ttft_p50_ms", [r.ttft_p50_s * 1000 for r in runs]),
            ("ttft_p90_ms", [r.ttft_p90_s * 1000 for r in runs]),
            ("imbalance", [r.imbalance for r in runs]),
        ):
            finite = [v for v in values if v == v]
            row[name] = {"median": _median(values), "min": min(finite, default=float("nan")),
                         "max": max(finite, default=float("nan")), "each": values}  # fmt: skip
        row["splits"] = [list(r.split.values()) for r in runs]
        row["failed"] = sum(r.failed for r in runs)
        out.append(row)
    return out


def _figure(cell: dict[str, Any], digits: int) -> str:
    return f"{cell['median']:.{digits}f} ({cell['min']:.{digits}f}-{cell['max']:.{digits}f})"


def report_markdown(results: list[PhaseResult], meta: dict[str, Any], goals: dict[str, dict[str, Any]]) -> str:
    workloads = meta.get("workloads") or {}
    lines = [
        "# Cache-aware routing: two tiny replicas, the gateway and vllm-router, multi-tenant workloads",
        "",
        f"Run {meta['started']} on {meta['host']} ({meta['cpus']} CPUs; load average before: {meta['load_before']}, "
        f"after: {meta['load_after']}).",
        "",
        f"Command: `{meta['command']}` (gateway code: {meta['gateway_code']})",
        "",
    ]
    for name, spec in workloads.items():
        lines.append(
            f"- Workload `{name}`: {spec['workload']}; {spec['requests']} requests per policy, {spec['concurrency']} "
            f"at a time{', shuffled' if spec['shuffle'] else ''}."
        )
    lines += [
        f"- Temperature 0, the gateway's trimming {meta['trimming']}. Engines: {meta['engines']} ({meta['profile']})"
        + ("; replica i pinned to core i." if meta.get("engines_pinned") else "."),
        "- Hit share: the engines' own `vllm:prefix_cache_hits_total / queries_total` deltas (tokens); "
        "`cached_tokens` is the answers' `usage.prompt_tokens_details.cached_tokens` over prompt tokens.",
        "",
        "## Median (range) over every round",
        "",
        "| workload | policy | rounds | hit share | TTFT p50 ms | TTFT p90 ms | requests per replica | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in medians(results):
        splits = ", ".join(" / ".join(str(v) for v in split) for split in row["splits"])
        lines.append(
            f"| {row['workload']} | {row['label']} | {row['runs']} | {_figure(row['hit_share'], 3)} | "
            f"{_figure(row['ttft_p50_ms'], 0)} | {_figure(row['ttft_p90_ms'], 0)} | {splits} | {row['failed']} |"
        )
    lines += [
        "",
        "## Every phase",
        "",
        "| workload | round | policy | requests (failed) | hit share (engines) | cached_tokens share | "
        "TTFT p50 ms | TTFT p90 ms | split | routing reasons | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items(), key=lambda kv: -kv[1])) or "-"
        lines.append(
            f"| {r.workload} | {r.round} | {r.label} | {r.requests} ({r.failed}) | {r.engine_share:.3f} | "
            f"{r.cached_share:.3f} | {r.ttft_p50_s * 1000:.0f} | {r.ttft_p90_s * 1000:.0f} | "
            f"{' / '.join(str(v) for v in r.split.values())} | {reasons} | {r.seconds:.0f} |"
        )
    lines += ["", "## Goals (per workload and round, against that round's oracle, vllm-router and round robin)", ""]
    for name, checks in goals.items():
        parts = [
            f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {'yes' if v else 'NO'}" if isinstance(v, bool)
            else f"{k}: {v}"
            for k, v in checks.items()
        ]  # fmt: skip
        lines.append(f"- {name}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.routing_experiment",
        description="Cache-aware routing against round robin, today's policy and an oracle, on two real tiny replicas.",
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="gateway config with the engines")
    parser.add_argument("--base-port", type=int, default=None, help="first engine port (default: the config's)")
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, in order (default: {','.join(DEFAULT_POLICIES)}; choices: {','.join(POLICIES)})",
    )
    parser.add_argument(
        "--workloads",
        default="tenants,hot-prefix",
        help=f"comma-separated, in order, each with every policy ({', '.join(WORKLOADS)}, or `custom`: the "
        "workload options below, --concurrency at a time, in the order loadtest.tenants gives)",
    )
    parser.add_argument(
        "--weights", type=parse_weights, action="append", default=[], metavar="NAME=N[,NAME=N]",
        help="also run cache_aware with these scorer weights over the defaults (repeatable), e.g. balance=0",
    )  # fmt: skip
    parser.add_argument("--weights-index", choices=CACHE_AWARE, default="precise", help="index of the --weights runs")
    parser.add_argument(
        "--before", default=None, metavar="COMMIT",
        help="also run each cache-aware policy with this commit's gateway, right after it (a before/after pair)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="repeat every policy this many times (same engines)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="conversations in flight (default: each workload's own; custom: 4)",
    )
    parser.add_argument(
        "--pin-engines",
        action="store_true",
        help="replica i on core i only (separate compute, as on GPUs); the gateway and load tester float",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        help="seconds between the gateway's scrapes of each engine's /metrics (default: the gateway's own, 5). "
        "Runs l-n used 0.5: then the engines' KV usage moves within a 2-3 s phase and the kv_usage score with it",
    )
    parser.add_argument(
        "--code",
        default="HEAD",
        help="git commit the gateways run (a copy of its server/), or `tree`: the working tree",
    )
    parser.add_argument(
        "--trimming",
        choices=("off", "auto", "window", "strict"),
        default="off",
        help="the gateway's history trimming (default off: its /tokenize calls go through the pool too, "
        "which advances round robin's turn and counts as outstanding; the prompts fit anyway)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="a new folder for report.md, summary.json, command.txt (default: a new one under "
        "loadtest/results/cache-aware-routing/, named by the start time and the gateway's commit); "
        "a folder that already holds a run is refused",
    )
    group = parser.add_argument_group("the `custom` workload (loadtest.tenants)")
    defaults = Workload()
    group.add_argument("--tenants", type=int, default=defaults.tenants)
    group.add_argument("--family-size", type=int, default=defaults.family_size, help="tenants sharing a preamble")
    group.add_argument("--shared-chars", type=int, default=defaults.shared_chars, help="the preamble's characters")
    group.add_argument("--system-chars", type=int, default=defaults.system_chars, help="each system prompt's chars")
    group.add_argument("--conversations", type=int, default=defaults.conversations, help="per tenant")
    group.add_argument("--turns", type=int, default=defaults.turns, help="per conversation")
    group.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="per answer")
    group.add_argument("--seed", type=int, default=defaults.seed)
    return parser


async def experiment(args: argparse.Namespace, argv: list[str]) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        say(f"error: unknown policies {unknown} (choose from {', '.join(POLICIES)})")
        return 2
    specs: dict[str, WorkloadSpec] = {}
    for name in filter(None, (w.strip() for w in args.workloads.split(","))):
        if name == "custom":
            custom = Workload(
                tenants=args.tenants, family_size=args.family_size, shared_chars=args.shared_chars,
                system_chars=args.system_chars, conversations=args.conversations, turns=args.turns,
                max_tokens=args.max_tokens, seed=args.seed,
            )  # fmt: skip
            specs[name] = WorkloadSpec(name, custom, args.concurrency or 4, shuffle=False)
        elif name in WORKLOADS:
            spec = WORKLOADS[name]
            specs[name] = WorkloadSpec(name, spec.workload, args.concurrency or spec.concurrency, spec.shuffle)
        else:
            say(f"error: unknown workload {name!r} (choose from {', '.join(WORKLOADS)}, custom)")
            return 2
    if not specs:
        say("error: no workload given")
        return 2
    output = run_folder(args.output, args.code)
    if output is None:
        say(f"error: {args.output} already holds a run; give a new --output (a run never writes over an old one)")
        return 2
    args.output = output
    conversations = {name: ordered_sessions(spec) for name, spec in specs.items()}
    todo = phases(policies, args.weights, args.weights_index, args.before)
    workdir = Path(tempfile.mkdtemp(prefix="routing-experiment-"))
    say(f"logs and derived configs in {workdir}")
    config = derived_config(
        args.config.resolve(), workdir, "engines", None, base_port=args.base_port, trimming=args.trimming
    )
    settings = load_settings(config)
    plan = plan_deployment(settings.models, config=config, placement="local")
    served = plan.served_models()
    if len(served) != 1 or len(served[0].urls) < 2:
        say(f"error: {args.config} must serve one model with at least two replicas")
        return 2
    model, engines = served[0].name, served[0].urls
    profile = plan.models[0].profile
    path = profile.model_path if profile is not None else None
    args.model_path = str(path) if path is not None else None  # vllm-router kv_aware's model identity
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_before": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "command": shlex.join(["python", "-m", "bench.routing_experiment", *argv]),
        "workloads": {
            name: {
                "workload": spec.workload.__dict__,
                "requests": spec.workload.requests,
                "concurrency": spec.concurrency,
                "shuffle": spec.shuffle,
            }
            for name, spec in specs.items()
        },  # fmt: skip
        "trimming": args.trimming,
        "scrape_interval": args.scrape_interval,
        "engines_pinned": args.pin_engines,
        "engines": engines,
        "profile": str(plan.models[0].profile_path.relative_to(ROOT)) if plan.models[0].profile_path else None,
        "phases": [p.__dict__ for p in todo],
        "logs": str(workdir),
        "gateway_code": commit_of(args.code),
    }
    say(f"starting {len(plan.engines)} engines ({', '.join(engines)}); phases: {', '.join(p.label for p in todo)}")
    say(f"engine output: {workdir / 'engines.log'}")
    results: list[PhaseResult] = []
    with engine_output(workdir / "engines.log"):
        await run_all(args, todo, plan, config, workdir, engines, model, specs, conversations, results, meta)
    meta["load_after"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    write_results(args.output, results, meta)
    say(f"wrote {args.output}/report.md and summary.json")
    return 0


def run_folder(requested: Path | None, code: str) -> Path | None:
    """The folder this run writes into: `requested`, unless it already holds a run (None then), or
    by default a new one named by the start time (UTC) and the commit the gateways run, so that
    `make routing-experiment` never writes over an earlier run's figures."""
    if requested is None:
        stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
        return DEFAULT_OUTPUT / f"{stamp}-{commit_of(code).replace(' ', '-')}"
    return None if (requested / "summary.json").exists() else requested


@contextlib.contextmanager
def engine_output(path: Path) -> Iterator[None]:
    """The supervisor copies every engine line to sys.stderr: to a file instead, while it runs."""
    saved = sys.stderr
    with path.open("a", buffering=1) as out:
        sys.stderr = out
        try:
            yield
        finally:
            sys.stderr = saved


async def run_all(
    args: argparse.Namespace, todo: list[Phase], plan: DeploymentPlan, config: Path, workdir: Path,
    engines: list[str], model: str, specs: dict[str, WorkloadSpec], conversations: dict[str, list[Session]],
    results: list[PhaseResult], meta: dict[str, Any],
) -> None:  # fmt: skip
    """Start the engines, run every phase of every round, stop the engines (on any exit)."""
    code: dict[str | None, Path] = {None: gateway_code(workdir, args.code)}
    for phase in todo:
        if phase.code is not None and phase.code not in code:
            code[phase.code] = gateway_code(workdir, phase.code)
    supervisors = await start_engines(plan, pin=args.pin_engines)
    try:
        with Processes(workdir) as processes:
            for round_ in range(1, args.rounds + 1):
                for name, spec in specs.items():
                    for phase in todo:
                        results.append(
                            await run_phase(
                                phase,
                                round_,
                                args=args,
                                config=config,
                                workdir=workdir,
                                processes=processes,
                                engines=engines,
                                model=model,
                                conversations=conversations[name],
                                code=code,
                                workload=name,
                                concurrency=spec.concurrency,
                            )  # fmt: skip
                        )
                        write_results(args.output, results, meta)  # a partial run still leaves its figures
    finally:
        await stop_engines(supervisors)


def write_results(output: Path, results: list[PhaseResult], meta: dict[str, Any]) -> None:
    meta = {"load_after": "(running)", **meta}
    goals = judge(results)
    output.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta, "results": [r.to_json() for r in results], "medians": medians(results), "goals": goals}
    (output / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (output / "report.md").write_text(report_markdown(results, meta, goals))
    (output / "command.txt").write_text(meta["command"] + "\n")
    with gzip.open(output / "requests.jsonl.gz", "wt") as out:  # every request, for the figures' why
        for r in results:
            for row in r.rows:
                out.write(json.dumps({"workload": r.workload, "round": r.round, "phase": r.label, **row}) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def guarded() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)  # SIGINT: asyncio.run cancels already
        return await experiment(args, argv)

    try:
        return asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("interrupted: every process started was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
