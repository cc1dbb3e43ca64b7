"""The response store's faults, with a stand-in engine (the claims are about the store): a
database that cannot be opened refuses the gateway's start with the reason; one that goes away
mid-run answers stateful requests 503 in the envelope while stateless ones are still served, and
serves again when it is back; 200 concurrent conversations lose no turn (every completed turn is
retrievable afterwards: counted)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from server.deploy.plan import plan_deployment
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.postgres import PostgresStore
from standin.surface import SurfaceStandin
from tests.gateway.conftest import ROOT, fast_settings, served_gateway
from tests.gateway.conversations.postgres_server import binaries, postgres_server
from tests.support import wait_for

CONVERSATIONS = 200
TURNS = 3
UNREACHABLE = "postgresql://gw:secret@127.0.0.1:9/none"  # nothing listens on port 9 (discard)


@pytest.fixture
def standin() -> Iterator[str]:
    from tests.support import serve_in_thread

    with serve_in_thread(SurfaceStandin()) as url:
        yield url


@pytest.mark.parametrize(
    ("store", "environ", "reason"),
    [
        ("{backend: postgres}", {"GATEWAY_DATABASE_URL": UNREACHABLE}, "Connection refused"),
        ("{backend: postgres}", {}, "GATEWAY_DATABASE_URL"),
        ("{backend: sqlite, path: /proc/no-such-place/responses.sqlite3}", {}, "cannot be opened"),
    ],
    ids=["postgres-unreachable", "postgres-no-url", "sqlite-unwritable"],
)
def test_a_store_that_cannot_be_opened_refuses_the_start_with_the_reason(standin, tmp_path, store, environ, reason):
    config = tmp_path / "gateway.yaml"
    config.write_text(f"responses_store: {store}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")} | environ
    started = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--config", str(config), "--upstream", f"standin={standin}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert "response" in started.stderr and reason in started.stderr
    assert "secret" not in started.stderr + started.stdout  # the URL's password is never written


def test_a_database_gone_mid_run_is_503_for_stateful_requests_only_and_then_back(standin, tmp_path):
    if binaries() is None:
        pytest.skip("PostgreSQL is not installed (/usr/lib/postgresql/*/bin)")
    with postgres_server(tmp_path / "pg") as server:
        settings = fast_settings({"standin": [standin]}, responses_store={"backend": "postgres"})
        models = plan_deployment(settings.models).served_models()
        with served_gateway(settings, models, 1, tmp_path, environ={"GATEWAY_DATABASE_URL": server.url}) as gw:
            first = httpx.post(f"{gw.url}/v1/responses", json={"model": "standin", "input": "hi"}, timeout=60)
            assert first.status_code == 200, first.text
            stored = f"{gw.url}/v1/responses/{first.json()['id']}"
            # Stored once the answer went out (conversations.answer): retrievable before the database goes.
            wait_for(lambda: httpx.get(stored, timeout=60).status_code == 200, timeout=60, what="the first response")
            server.stop()
            for method, path, body in (
                ("POST", "/v1/responses", {"model": "standin", "input": "again"}),
                (
                    "POST",
                    "/v1/responses",
                    {"model": "standin", "input": "x", "previous_response_id": first.json()["id"]},
                ),
                ("GET", f"/v1/responses/{first.json()['id']}", None),
            ):
                refused = httpx.request(method, f"{gw.url}{path}", json=body, timeout=60)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "response_store_unavailable"
            stateless = httpx.post(
                f"{gw.url}/v1/responses", json={"model": "standin", "input": "x", "store": False}, timeout=60
            )
            assert stateless.status_code == 200
            chat = httpx.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": "standin", "messages": [{"role": "user", "content": "x"}]},
                timeout=60,
            )
            assert chat.status_code in (200, 404)  # never the store's 503 (the stand-in may not serve chat)
            server.start_again()

            def back() -> bool:
                answer = httpx.get(f"{gw.url}/v1/responses/{first.json()['id']}", timeout=60)
                return answer.status_code == 200

            wait_for(back, timeout=120, interval=0.5, what="the stored response once the database is back")


async def test_a_store_that_found_the_database_gone_waits_briefly_for_it_until_a_call_succeeds(tmp_path):
    """The state behind the 503s above: a call that waited out a busy pool leaves the store as it
    was; the first call that waits it out while the database is gone marks the store unreachable
    (the calls after it wait `UNREACHABLE_TIMEOUT` for a connection, not the pool's timeout), and
    the first call that succeeds once the database is back clears it. No time is asserted."""
    if binaries() is None:
        pytest.skip("PostgreSQL is not installed (/usr/lib/postgresql/*/bin)")
    with postgres_server(tmp_path / "pg") as server:
        store = PostgresStore(server.url, max_size=1, timeout=2.0)  # (its first wait: 2 s, not 10)
        await store.open()
        try:
            await store.check()
            async with store._pool.connection():  # its one connection busy: load, not an outage
                with pytest.raises(StoreUnavailable):
                    await store.check()
            assert not store.unreachable
            server.stop()
            for _ in range(3):
                with pytest.raises(StoreUnavailable):
                    await store.get("t", "resp_x", time.time())
                assert store.unreachable
            server.start_again()
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert await store.get("t", "resp_x", time.time()) is None
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "the store never reached the database again"
                    await asyncio.sleep(0.5)
            assert not store.unreachable
        finally:
            await store.close()


async def _conversation(client: httpx.AsyncClient, index: int) -> list[str]:
    previous, done = None, []
    for turn in range(TURNS):
        body = {"model": "standin", "input": f"c{index} t{turn}", "previous_response_id": previous}
        answer = await client.post("/v1/responses", json=body)
        assert answer.status_code == 200, answer.text
        previous = answer.json()["id"]
        done.append(previous)
    return done


def test_two_hundred_concurrent_conversations_lose_no_turn(standin, tmp_path):
    store = tmp_path / "responses.sqlite3"
    settings = fast_settings({"standin": [standin]}, responses_store={"backend": "sqlite", "path": str(store)})
    models = plan_deployment(settings.models).served_models()

    async def run(url: str) -> tuple[list[list[str]], int]:
        limits = httpx.Limits(max_connections=CONVERSATIONS)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            done = await asyncio.gather(*(_conversation(client, i) for i in range(CONVERSATIONS)))
            found = await asyncio.gather(*(client.get(f"/v1/responses/{rid}") for ids in done for rid in ids))
            return list(done), sum(1 for answer in found if answer.status_code == 200)

    with served_gateway(settings, models, 1, tmp_path) as gw:
        done, retrievable = asyncio.run(run(gw.url))
    completed = sum(len(ids) for ids in done)
    assert completed == CONVERSATIONS * TURNS
    assert retrievable == completed
