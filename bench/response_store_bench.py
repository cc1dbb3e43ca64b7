"""What the gateway's response store adds to a stored turn, per backend, side by side in one run.

Two measurements, each in rounds (the backends in a rotated order each round):

    turn   through the whole gateway (in this process, uvicorn on loopback) in front of a stand-in
           engine (standin.surface, answers at once): a request with `store: true` against the same
           request with `store: false`, interleaved one for one. The difference of their latencies
           is what storing adds to a turn (a check of the database before the request, the answer
           read on its way, the record written after it), as the client sees it.
    chain  the store alone: loading a chain of `--chain` turns (one recursive query, the rows
           decoded), the call a continuation makes before its engine request.

Backends: sqlite (a file in a temporary folder, WAL) and postgres (a real server started here
with initdb, as the tests do: tests/gateway/conversations/postgres_server.py). Figures: the
median over rounds of each round's p50 and p99, with the range over rounds.

    python -m bench.response_store_bench [--rounds 5] [--turns 400] [--chain 100] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.conversations.postgres import PostgresStore
from server.gateway.conversations.records import StoredResponse, input_items, new_response_id
from server.gateway.conversations.sqlite import SqliteStore
from server.gateway.conversations.store import ResponseStore
from server.gateway.settings import GatewaySettings, ModelEngines
from standin.surface import SurfaceStandin
from tests.gateway.conversations.postgres_server import postgres_server
from tests.support import serve_in_thread


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def new_database(server_url: str) -> str:
    name = "b" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as db:
        db.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    return server_url.rsplit("/", 1)[0] + "/" + name


def gateway_settings(engine: str, backend: str, folder: Path) -> GatewaySettings:
    store: dict[str, Any] = {"backend": backend}
    if backend == "sqlite":
        store["path"] = str(folder / f"{uuid.uuid4().hex}.sqlite3")
    return GatewaySettings(
        models=[ModelEngines(name="standin", urls=[engine])], responses_store=store, access_log=False
    )


def measure_turns(engine: str, backend: str, folder: Path, turns: int, environ: dict[str, str]) -> dict[str, float]:
    """Per turn (ms): p50/p99 of store:true, of store:false, and of their paired differences."""
    settings = gateway_settings(engine, backend, folder)
    app = create_app(settings, plan_deployment(settings.models).served_models(), log_request=None, environ=environ)
    stored: list[float] = []
    stateless: list[float] = []
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        body = {"model": "standin", "input": "Plan a day in Lisbon.", "max_output_tokens": 8}
        for _ in range(20):  # warm-up
            client.post("/v1/responses", json=body).raise_for_status()
        for index in range(turns):
            for store in (True, False) if index % 2 == 0 else (False, True):
                started = time.perf_counter()
                client.post("/v1/responses", json={**body, "store": store}).raise_for_status()
                (stored if store else stateless).append((time.perf_counter() - started) * 1000)
    added = [a - b for a, b in zip(stored, stateless, strict=True)]
    return {
        "stored_p50_ms": percentile(stored, 0.5),
        "stored_p99_ms": percentile(stored, 0.99),
        "stateless_p50_ms": percentile(stateless, 0.5),
        "stateless_p99_ms": percentile(stateless, 0.99),
        "added_p50_ms": percentile(stored, 0.5) - percentile(stateless, 0.5),
        "added_p99_ms": percentile(stored, 0.99) - percentile(stateless, 0.99),
        "paired_added_p50_ms": percentile(added, 0.5),
    }


async def measure_chain(store: ResponseStore, length: int, loads: int) -> dict[str, float]:
    await store.open()
    try:
        previous = None
        for turn in range(length):
            rid = new_response_id()
            text = f"Question {turn}: " + "plan a trip with museums and markets " * 8
            await store.save(
                StoredResponse(
                    id=rid,
                    tenant="bench",
                    model="tiny",
                    status="completed",
                    input_items=input_items(text),
                    output_items=[
                        {
                            "id": f"msg_{turn}",
                            "type": "message",
                            "role": "assistant",
                            "status": "completed",
                            "content": [{"type": "output_text", "text": "answer " * 40, "annotations": []}],
                        }
                    ],
                    response={"id": rid, "object": "response", "status": "completed", "output": []},
                    previous_response_id=previous,
                    expires_at=time.time() + 86400,
                )
            )
            previous = rid
        assert previous is not None
        times = []
        for _ in range(loads):
            started = time.perf_counter()
            chain = await store.chain("bench", previous, time.time())
            times.append((time.perf_counter() - started) * 1000)
            assert len(chain) == length
        return {"chain_p50_ms": percentile(times, 0.5), "chain_p99_ms": percentile(times, 0.99)}
    finally:
        await store.close()


def summary(rounds: list[dict[str, dict[str, float]]], backend: str, key: str) -> dict[str, float]:
    values = [r[backend][key] for r in rounds]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--chain", type=int, default=100)
    parser.add_argument("--loads", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as folder, postgres_server(Path(folder) / "pg") as server:
        standin = SurfaceStandin()
        with serve_in_thread(standin) as engine:
            backends = ["sqlite", "postgres"]
            for number in range(args.rounds):
                order = backends[number % 2 :] + backends[: number % 2]
                result: dict[str, dict[str, float]] = {}
                for backend in order:
                    url = new_database(server.url)
                    environ = {"GATEWAY_DATABASE_URL": url}
                    turn = measure_turns(engine, backend, Path(folder), args.turns, environ)
                    store: ResponseStore = (
                        SqliteStore(Path(folder) / f"chain-{uuid.uuid4().hex}.sqlite3")
                        if backend == "sqlite"
                        else PostgresStore(new_database(server.url))
                    )
                    chain = asyncio.run(measure_chain(store, args.chain, args.loads))
                    result[backend] = {**turn, **chain}
                    print(
                        f"round {number + 1} {backend}: "
                        + json.dumps({k: round(v, 3) for k, v in result[backend].items()})
                    )
                rounds.append(result)
    keys = list(rounds[0]["sqlite"])
    report = {
        "commit": commit,
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
            "note": "shared machine",
        },
        "parameters": vars(args) | {"out": str(args.out)},
        "rounds": rounds,
        "summary": {
            backend: {key: summary(rounds, backend, key) for key in keys} for backend in ("sqlite", "postgres")
        },
    }
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
