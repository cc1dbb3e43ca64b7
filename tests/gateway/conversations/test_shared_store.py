"""One conversation, several gateway processes: two gateways (two workers each) on one real
PostgreSQL server continue each other's turns, and the two workers of `--workers 2` do the same on
one SQLite file. The engine is a stand-in (the claim is about the store): it shows what each
turn was sent, the whole chain, stateless."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from server.deploy.plan import plan_deployment
from server.gateway.serving.supervisor import WORKER_HEADER
from standin.surface import SurfaceStandin
from tests.gateway.conftest import WorkerTree, fast_settings
from tests.support import serve_in_thread

TURNS = 8


@pytest.fixture
def standin() -> Iterator[tuple[str, SurfaceStandin]]:
    app = SurfaceStandin()
    with serve_in_thread(app) as url:
        yield url, app


def database(server) -> str:
    name = "g" + uuid.uuid4().hex[:12]
    with psycopg.connect(server.url, autocommit=True) as db:
        db.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    return server.url.rsplit("/", 1)[0] + "/" + name


def converse(urls: list[str]) -> tuple[list[str], set[str]]:
    """TURNS turns, turn i through gateway urls[i % len(urls)] on a new connection each; the ids and
    the workers that answered."""
    previous = None
    ids, workers = [], set()
    for turn in range(TURNS):
        url = urls[turn % len(urls)]
        body = {"model": "standin", "input": f"turn {turn}", "previous_response_id": previous}
        answer = httpx.post(f"{url}/v1/responses", json=body, headers={"connection": "close"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["previous_response_id"] == previous
        workers.add(f"{url}#{answer.headers.get(WORKER_HEADER, '?')}")
        previous = answer.json()["id"]
        ids.append(previous)
    return ids, workers


def check_the_chain(app: SurfaceStandin, urls: list[str], ids: list[str]) -> None:
    sent = [json.loads(r.body) for r in app.requests if r.path == "/v1/responses"]
    assert [len(body["input"]) if isinstance(body["input"], list) else 1 for body in sent] == [
        1 if turn == 0 else 2 * turn + 1 for turn in range(TURNS)
    ]
    for url in urls:  # every gateway reads every turn
        for index, response_id in enumerate(ids):
            items = httpx.get(f"{url}/v1/responses/{response_id}/input_items", timeout=30).json()["data"]
            assert [item["content"][0]["text"] for item in items] == [f"turn {index}"]


def test_two_gateways_on_one_postgres_continue_each_others_conversations(postgres, standin, tmp_path):
    url, app = standin
    environ = {"GATEWAY_DATABASE_URL": database(postgres)}
    settings = fast_settings({"standin": [url]}, responses_store={"backend": "postgres"})
    models = plan_deployment(settings.models).served_models()
    with (
        WorkerTree(settings, models, 2, environ, tmp_path).serving() as first,
        WorkerTree(settings, models, 2, environ, tmp_path).serving() as second,
    ):
        ids, workers = converse([first, second])
        check_the_chain(app, [first, second], ids)
        assert httpx.delete(f"{second}/v1/responses/{ids[0]}", timeout=30).status_code == 200
        assert httpx.get(f"{first}/v1/responses/{ids[0]}", timeout=30).status_code == 404  # gone for both
    assert len({worker.split("#")[0] for worker in workers}) == 2


def test_two_workers_on_one_sqlite_file_continue_each_others_conversations(standin, tmp_path):
    url, app = standin
    store = tmp_path / "responses.sqlite3"
    settings = fast_settings({"standin": [url]}, responses_store={"backend": "sqlite", "path": str(store)})
    models = plan_deployment(settings.models).served_models()
    with WorkerTree(settings, models, 2, None, tmp_path).serving() as gateway:
        ids, workers = converse([gateway] * 1)
        check_the_chain(app, [gateway], ids)
        # Each new connection goes to either worker: by TURNS turns both have answered some.
        extra = 0
        while len(workers) < 2 and extra < 50:
            ids, more = converse([gateway])
            workers |= more
            extra += 1
    assert len(workers) == 2, f"both workers served turns of the conversation: {workers}"
