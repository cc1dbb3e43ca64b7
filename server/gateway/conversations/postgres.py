"""The shared response store: one PostgreSQL database for every gateway replica (psycopg 3, async pool).

Connections come from an `AsyncConnectionPool` opened at start-up (a database that cannot be
reached then refuses the start, with the reason); a call that finds it down later raises
`StoreUnavailable` (503). Migrations run under a transaction-scoped advisory lock, so replicas
that start together migrate once. Every statement takes parameters; none is built from values.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from server.gateway.conversations import migrations
from server.gateway.conversations.codec import COLUMNS, from_row, to_row
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.records import StoredResponse
from server.gateway.conversations.store import MAX_CHAIN

MIGRATION_LOCK = 0x7265737073  # pg_advisory_xact_lock key of the schema migrations ("resps")
CONNECT_TIMEOUT = 10.0

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

    def __init__(self, url: str, *, max_size: int = 10) -> None:
        self.description = _redacted(url)
        self._url = url
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            open=False,
            timeout=CONNECT_TIMEOUT,
            kwargs={"autocommit": True, "connect_timeout": int(CONNECT_TIMEOUT)},
            check=AsyncConnectionPool.check_connection,
        )

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

    async def _execute(self, query: str, params: dict[str, Any]) -> psycopg.AsyncCursor[Any]:
        async with self._pool.connection() as db:
            return await db.execute(query, params)

    async def check(self) -> None:
        try:
            await self._execute("SELECT 1", {})
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None

    async def save(self, response: StoredResponse) -> None:
        try:
            await self._execute(_SAVE, to_row(response))
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None

    async def get(self, tenant: str, response_id: str, now: float) -> StoredResponse | None:
        try:
            async with self._pool.connection() as db:
                cursor = await db.execute(_GET, {"tenant": tenant, "id": response_id, "now": now})
                row = await cursor.fetchone()
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None
        return from_row(row) if row is not None else None

    async def chain(self, tenant: str, response_id: str, now: float) -> list[StoredResponse]:
        params = {"tenant": tenant, "id": response_id, "now": now, "limit": MAX_CHAIN}
        try:
            async with self._pool.connection() as db:
                cursor = await db.execute(_CHAIN, params)
                rows = await cursor.fetchall()
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None
        return [from_row(row) for row in rows]

    async def delete(self, tenant: str, response_id: str) -> bool:
        try:
            async with self._pool.connection() as db:
                cursor = await db.execute(_DELETE, {"tenant": tenant, "id": response_id})
                return cursor.rowcount > 0
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None

    async def purge(self, now: float) -> int:
        try:
            async with self._pool.connection() as db:
                cursor = await db.execute(_PURGE, {"now": now})
                return cursor.rowcount
        except (psycopg.Error, PoolTimeout) as exc:
            raise self._failed(exc) from None

    async def close(self) -> None:
        await self._pool.close()
