"""The response store's backends against real databases: a SQLite file and a real PostgreSQL
server (initdb in a temporary folder). The same tests run on both."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest

from server.gateway.conversations import migrations
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.postgres import PostgresStore
from server.gateway.conversations.records import StoredResponse, chain_input, input_items, new_response_id
from server.gateway.conversations.sqlite import SqliteStore
from server.gateway.conversations.store import ResponseStore, open_store
from server.gateway.settings import ResponsesStore

NOW = 1_800_000_000.0


def turn(tenant: str, previous: str | None, text: str, *, expires: float = NOW + 3600) -> StoredResponse:
    rid = new_response_id()
    return StoredResponse(
        id=rid,
        tenant=tenant,
        model="tiny",
        status="completed",
        input_items=input_items(text),
        output_items=[
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "re " + text}]}
        ],
        response={"id": rid, "object": "response", "status": "completed"},
        previous_response_id=previous,
        instructions="be brief",
        usage={"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
        created_at=NOW,
        expires_at=expires,
    )


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[ResponseStore]:
    if request.param == "sqlite":
        opened: ResponseStore = SqliteStore(tmp_path / "data" / "responses.sqlite3")
    else:
        server = request.getfixturevalue("postgres")
        name = "t" + uuid.uuid4().hex[:12]
        with psycopg.connect(server.url, autocommit=True) as db:
            db.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
        opened = PostgresStore(server.url.rsplit("/", 1)[0] + "/" + name)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


async def test_a_saved_response_reads_back_whole(store):
    saved = turn("planner", None, "hello")
    await store.save(saved)
    assert await store.get("planner", saved.id, NOW) == saved


async def test_another_tenant_sees_nothing(store):
    saved = turn("planner", None, "secret plans")
    await store.save(saved)
    assert await store.get("articles", saved.id, NOW) is None
    assert await store.chain("articles", saved.id, NOW) == []
    assert await store.delete("articles", saved.id) is False
    assert await store.get("planner", saved.id, NOW) is not None


async def test_a_chain_loads_oldest_first_and_builds_the_whole_input(store):
    previous = None
    turns = []
    for index in range(5):
        saved = turn("", previous, f"turn {index}")
        await store.save(saved)
        turns.append(saved)
        previous = saved.id
    chain = await store.chain("", previous, NOW)
    assert [t.id for t in chain] == [t.id for t in turns]
    items = chain_input(chain, "next")
    texts = [item["content"][0]["text"] for item in items]
    assert texts == [x for i in range(5) for x in (f"turn {i}", f"re turn {i}")] + ["next"]
    # A chain from the middle stops at its own start.
    assert [t.id for t in await store.chain("", turns[2].id, NOW)] == [t.id for t in turns[:3]]


async def test_delete_and_expiry_and_purge(store):
    kept = turn("", None, "kept")
    old = turn("", None, "old", expires=NOW - 1)
    gone = turn("", None, "gone")
    for saved in (kept, old, gone):
        await store.save(saved)
    assert await store.get("", old.id, NOW) is None  # expired: absent before the purge
    assert await store.delete("", gone.id) is True
    assert await store.delete("", gone.id) is False
    assert await store.purge(NOW) == 1
    assert await store.get("", kept.id, NOW) is not None


async def test_saving_again_replaces_status_and_record(store):
    saved = turn("", None, "x")
    await store.save(saved)
    saved.status, saved.output_items = "incomplete", []
    await store.save(saved)
    again = await store.get("", saved.id, NOW)
    assert again is not None and again.status == "incomplete" and again.output_items == []


async def test_sqlite_migrates_once_and_refuses_a_newer_schema(tmp_path):
    path = tmp_path / "responses.sqlite3"
    for _ in range(2):
        store = SqliteStore(path)
        await store.open()
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(migrations.CURRENT,)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        db.execute("UPDATE schema_version SET version = ?", (migrations.CURRENT + 1,))
    store = SqliteStore(path)
    with pytest.raises(StoreUnavailable, match="newer than this gateway"):
        await store.open()
    await store.close()


async def test_sqlite_unopenable_file_is_refused_with_the_reason(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    store = SqliteStore(tmp_path / "file" / "responses.sqlite3")
    with pytest.raises(StoreUnavailable, match="cannot be opened"):
        await store.open()
    await store.close()


async def test_postgres_unreachable_is_refused_with_the_reason():
    store = PostgresStore("postgresql://nobody:secret@127.0.0.1:1/none")
    with pytest.raises(StoreUnavailable, match="cannot be opened") as refused:
        await store.open()
    assert "secret" not in refused.value.message


def test_open_store_follows_the_settings(tmp_path):
    sqlite = open_store(ResponsesStore(path="r.sqlite3"), base=tmp_path)
    assert isinstance(sqlite, SqliteStore) and sqlite.path == tmp_path / "r.sqlite3"
    default = open_store(ResponsesStore(), environ={"GATEWAY_DATA_DIR": str(tmp_path / "d")})
    assert isinstance(default, SqliteStore) and default.path == tmp_path / "d" / "responses.sqlite3"
    assert open_store(ResponsesStore(backend="off")) is None
    with pytest.raises(StoreUnavailable, match="GATEWAY_DATABASE_URL"):
        open_store(ResponsesStore(backend="postgres"), environ={})
    assert isinstance(
        open_store(ResponsesStore(backend="postgres"), environ={"GATEWAY_DATABASE_URL": "postgresql://x@h/d"}),
        PostgresStore,
    )
