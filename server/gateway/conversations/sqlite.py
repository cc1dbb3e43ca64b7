"""The embedded response store: one SQLite file (WAL), every call on one thread of its own.

The event loop never waits on the file: each call runs on the store's single worker thread
(`ThreadPoolExecutor(max_workers=1)`), which owns the connection. WAL lets readers go on while
one writer writes, and lets several processes (`--workers N`) share the file; `busy_timeout`
makes a writer that meets another's lock wait for it (up to BUSY_TIMEOUT_MS) instead of failing.
Every statement takes parameters; none is built from values.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from server.gateway.conversations import migrations
from server.gateway.conversations.codec import COLUMNS, from_row, to_row
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.records import StoredResponse
from server.gateway.conversations.store import MAX_CHAIN

T = TypeVar("T")
BUSY_TIMEOUT_MS = 10_000

_SAVE = (
    f"INSERT INTO responses ({COLUMNS}) VALUES "
    "(:tenant, :id, :previous_response_id, :model, :status, :created_at, :expires_at, :record) "
    "ON CONFLICT (tenant, id) DO UPDATE SET status = excluded.status, record = excluded.record"
)
_GET = f"SELECT {COLUMNS} FROM responses WHERE tenant = :tenant AND id = :id AND expires_at > :now"
_CHAIN = f"""
WITH RECURSIVE chain(id, previous_response_id, depth) AS (
    SELECT id, previous_response_id, 0 FROM responses
     WHERE tenant = :tenant AND id = :id AND expires_at > :now
    UNION ALL
    SELECT r.id, r.previous_response_id, chain.depth + 1 FROM responses AS r
      JOIN chain ON r.id = chain.previous_response_id
     WHERE r.tenant = :tenant AND r.expires_at > :now AND chain.depth < :limit
)
SELECT {", ".join("r." + c.strip() for c in COLUMNS.split(","))} FROM chain
  JOIN responses AS r ON r.tenant = :tenant AND r.id = chain.id
 ORDER BY chain.depth DESC
"""
_DELETE = "DELETE FROM responses WHERE tenant = :tenant AND id = :id"
_PURGE = "DELETE FROM responses WHERE expires_at <= :now"


class SqliteStore:
    """Stored responses in one SQLite file (see the module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"sqlite {path}"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._connection: sqlite3.Connection | None = None

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            if self._connection is None:
                raise StoreUnavailable(f"The response store ({self.description}) is not open.")
            try:
                return work(self._connection)
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"The response store ({self.description}) failed: {exc}") from None

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def open(self) -> None:
        def connect() -> None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
                connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS:d}")
                connection.execute("PRAGMA journal_mode = WAL")
                connection.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at each checkpoint, never corrupt
                migrate(connection)
            except (OSError, sqlite3.Error) as exc:
                raise StoreUnavailable(f"The response store ({self.description}) cannot be opened: {exc}") from None
            self._connection = connection

        await asyncio.get_running_loop().run_in_executor(self._executor, connect)

    async def check(self) -> None:
        await self._run(lambda db: db.execute("SELECT 1").fetchone())

    async def save(self, response: StoredResponse) -> None:
        row = to_row(response)
        await self._run(lambda db: db.execute(_SAVE, row))

    async def get(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        def get(db: sqlite3.Connection) -> StoredResponse | None:
            row = db.execute(_GET, {"tenant": tenant, "id": response_id, "now": now}).fetchone()
            return from_row(row) if row is not None else None

        return await self._run(get)

    async def chain(self, tenant: str, response_id: str, now: float) -> list[StoredResponse]:
        params = {"tenant": tenant, "id": response_id, "now": now, "limit": MAX_CHAIN}
        return await self._run(lambda db: [from_row(row) for row in db.execute(_CHAIN, params).fetchall()])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._run(lambda db: db.execute(_DELETE, {"tenant": tenant, "id": response_id}).rowcount > 0)

    async def purge(self, now: float) -> int:
        return await self._run(lambda db: db.execute(_PURGE, {"now": now}).rowcount)

    async def close(self) -> None:
        def close() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=True)


def migrate(connection: sqlite3.Connection) -> int:
    """Run the migrations this file has not had, each in one transaction; the version now.

    `BEGIN IMMEDIATE` takes the write lock first, so two processes starting on one new file
    migrate it once (the second finds the version the first wrote)."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = connection.execute("SELECT version FROM schema_version").fetchone()
        version = row[0] if row is not None else 0
        if row is None:
            connection.execute("INSERT INTO schema_version (version) VALUES (0)")
        if version > migrations.CURRENT:
            raise sqlite3.DatabaseError(
                f"its schema is version {version}, newer than this gateway's {migrations.CURRENT}"
            )
        for statements in migrations.SQLITE[version:]:
            for statement in statements:
                connection.execute(statement)
        connection.execute("UPDATE schema_version SET version = ?", (migrations.CURRENT,))
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    return migrations.CURRENT
