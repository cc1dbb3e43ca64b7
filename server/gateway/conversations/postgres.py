"""The shared response store: one PostgreSQL database for every gateway replica (psycopg 3, async pool).

Connections come from an `AsyncConnectionPool` opened at start-up (a database that cannot be
reached then refuses the start, with the reason); a call that finds it down later raises
`StoreUnavailable` (503). Such a call waits the pool's `CONNECT_TIMEOUT` for a connection. Once one
has waited it out while the pool failed to connect (not merely had every connection busy), the
calls after it wait `UNREACHABLE_TIMEOUT` only, until one succeeds: while the database is down,
each stateful request gets its 503 within about a second instead of ten, and the pool keeps
reconnecting in the background. Migrations run under a transaction-scoped advisory lock, so replicas
that start together migrate once. Every statement takes parameters; none is built from values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from server.gateway.conversations import migrations
from server.gateway.conversations.codec import COLUMNS, from_row, to_row
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.records import StoredResponse
from server.gateway.conversations.store import MAX_CHAIN

MIGRATION_LOCK = 0x7265737073  # pg_advisory_xact_lock key of the schema migrations ("resps")
CONNECT_TIMEOUT = 10.0
UNREACHABLE_TIMEOUT = 1.0  # seconds a call waits for a connection while the database is known unreachable
T = TypeVar("T")
Cursor = psycopg.AsyncCursor[Any]

_SAVE = (
    f"INSERT INTO responses ({COLUMNS}) VALUES "
    "(%(tenant)s, %(id)s, %(previous_response_id)s, %(model)s, %(status)s, %(created_at)s, %(expires_at)s, "
    "%(record)s) ON CONFLICT (tenant, id) DO UPDATE SET status = excluded.status, record = excluded.record"
)
_GET = f"SELECT {COLUMNS} FROM responses WHERE tenant = %(tenant)s AND id = %(id)s AND expires_at > %(now)s"
_CHAIN = f"""
WITH RECURSIVE chain(id, previous_response_id, depth) AS (
    SELECT id, previous_response_id, 0 FROM responses
     WHERE tenant = %(tenant)s AND id = %(id)s AND expires_at > %(now)s
    UNION ALL
    SELECT r.id, r.previous_response_id, chain.depth + 1 FROM responses AS r
      JOIN chain ON r.id = chain.previous_response_id
     WHERE r.tenant = %(tenant)s AND r.expires_at > %(now)s AND chain.depth < %(limit)s
)
SELECT {", ".join("r." + c.strip() for c in COLUMNS.split(","))} FROM chain
  JOIN responses AS r ON r.tenant = %(tenant)s AND r.id = chain.id
 ORDER BY chain.depth DESC
"""
_DELETE = "DELETE FROM responses WHERE tenant = %(tenant)s AND id = %(id)s"
_PURGE = "DELETE FROM responses WHERE expires_at <= %(now)s"


def _redacted(url: str) -> str:
    """The URL without its password, for logs and errors."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgres (an unreadable URL)"
    user, host, port, name = (info.get(k, "") for k in ("user", "host", "port", "dbname"))
    return f"postgres {user}@{host or 'localhost'}:{port or 5432}/{name}"


class PostgresStore:
    """Stored responses in one PostgreSQL database (see the module doc)."""

    def __init__(self, url: str, *, max_size: int = 10, timeout: float = CONNECT_TIMEOUT) -> None:
        self.description = _redacted(url)
        self._url = url
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            open=False,
            timeout=timeout,
            kwargs={"autocommit": True, "connect_timeout": int(CONNECT_TIMEOUT)},
            check=AsyncConnectionPool.check_connection,
        )
        self.unreachable = False  # a call waited out the pool while it failed to connect (see the module doc)
        self._errors_at_success = 0  # the pool's failed connection attempts as of the last call that succeeded

    def _failed(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"The response store ({self.description}) failed: {str(exc).strip()[:300]}")

    async def open(self) -> None:
        try:
            # One connection first: its error says why (refused, no such database, bad password),
            # where the pool's would only say that it timed out.
            connection = await psycopg.AsyncConnection.connect(self._url, connect_timeout=int(CONNECT_TIMEOUT))
            await connection.close()
            await self._pool.open(wait=True, timeout=CONNECT_TIMEOUT)
            async with self._pool.connection() as db, db.transaction():
                await db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = await (await db.execute("SELECT version FROM schema_version")).fetchone()
                version = row[0] if row is not None else 0
                if row is None:
                    await db.execute("INSERT INTO schema_version (version) VALUES (0)")
                if version > migrations.CURRENT:
                    raise StoreUnavailable(
                        f"The response store ({self.description}) has schema version {version}, "
                        f"newer than this gateway's {migrations.CURRENT}."
                    )
                for statements in migrations.POSTGRES[version:]:
                    for statement in statements:
                        await db.execute(statement)
                await db.execute("UPDATE schema_version SET version = %s", (migrations.CURRENT,))
        except (psycopg.Error, PoolTimeout, OSError) as exc:
            await self._pool.close()
            reason = str(exc).strip().replace(self._url, self.description)[:500]
            raise StoreUnavailable(f"The response store ({self.description}) cannot be opened: {reason}") from None

    async def _run(self, query: str, params: dict[str, Any], read: Callable[[Cursor], Awaitable[T]]) -> T:
        """One statement on a connection of the pool, and `read(cursor)`; StoreUnavailable when the
        database cannot be reached or fails the statement (the waits: the module doc)."""
        pool = self._pool
        try:
            async with pool.connection(UNREACHABLE_TIMEOUT if self.unreachable else None) as db:
                out = await read(await db.execute(query, params))
        except PoolTimeout as exc:
            # Waited out: unreachable if the pool failed to connect since the last success, else
            # every connection was busy (load, not an outage: the next call waits as long).
            self.unreachable = pool.get_stats().get("connections_errors", 0) > self._errors_at_success
            raise self._failed(exc) from None
        except psycopg.OperationalError as exc:  # (the connection broke under the statement)
            self.unreachable = True
            raise self._failed(exc) from None
        except psycopg.Error as exc:
            raise self._failed(exc) from None
        self.unreachable = False
        self._errors_at_success = pool.get_stats().get("connections_errors", 0)  # (a dict of counters: microseconds)
        return out

    async def check(self) -> None:
        await self._run("SELECT 1", {}, _nothing)

    async def save(self, response: StoredResponse) -> None:
        await self._run(_SAVE, to_row(response), _nothing)

    async def get(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        row = await self._run(_GET, {"tenant": tenant, "id": response_id, "now": now}, _one)
        return from_row(row) if row is not None else None

    async def chain(self, tenant: str, response_id: str, now: float) -> list[StoredResponse]:
        params = {"tenant": tenant, "id": response_id, "now": now, "limit": MAX_CHAIN}
        return [from_row(row) for row in await self._run(_CHAIN, params, _all)]

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._run(_DELETE, {"tenant": tenant, "id": response_id}, _rowcount) > 0

    async def purge(self, now: float) -> int:
        return await self._run(_PURGE, {"now": now}, _rowcount)

    async def close(self) -> None:
        await self._pool.close()


async def _nothing(cursor: Cursor) -> None:
    return None


async def _one(cursor: Cursor) -> Any:
    return await cursor.fetchone()


async def _all(cursor: Cursor) -> list[Any]:
    return await cursor.fetchall()


async def _rowcount(cursor: Cursor) -> int:
    return cursor.rowcount
