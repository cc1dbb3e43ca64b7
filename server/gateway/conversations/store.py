"""The response store's one small interface, and the backend the settings name (`open_store`).

Every method may raise `StoreUnavailable` (errors): the database cannot be reached, is locked
past its timeout, or refused the statement. Reads and deletes are scoped by tenant: another
tenant's response is absent (None, an empty chain, False), never an error that tells it exists.
A response whose retention ended (`expires_at`) is absent too, before the purge removes it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from server.config import SettingsError
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.records import StoredResponse
from server.gateway.settings import ResponsesStore

DAY = 86400.0
DATA_DIR_ENV = "GATEWAY_DATA_DIR"  # the gateway's data folder (its SQLite response store)
MAX_CHAIN = 10_000  # turns loaded for one continuation at most (a cycle cannot be stored, but a bound is cheap)


class ResponseStore(Protocol):
    """Where stored responses live (sqlite.SqliteStore, postgres.PostgresStore)."""

    description: str  # for logs: the backend and where (never a password)

    async def open(self) -> None:
        """Connect and bring the schema to the current version; StoreUnavailable with the reason."""

    async def check(self) -> None:
        """Raise StoreUnavailable unless the database answers now (before a stateful request is sent)."""

    async def save(self, response: StoredResponse) -> None: ...

    async def get(self, tenant: str, response_id: str, now: float) -> StoredResponse | None: ...

    async def chain(self, tenant: str, response_id: str, now: float) -> list[StoredResponse]:
        """`response_id` and the responses it continues, oldest first; [] when it is absent."""

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def purge(self, now: float) -> int:
        """Remove the responses whose retention ended; how many."""

    async def close(self) -> None: ...


def retention_seconds(config: ResponsesStore, tenant: str) -> float:
    return config.tenant_retention_days.get(tenant, config.retention_days) * DAY


def open_store(
    config: ResponsesStore, *, environ: Mapping[str, str] | None = None, base: Path | None = None
) -> ResponseStore | None:
    """The store `config` names (not opened yet), or None for `backend: off`.

    A relative SQLite path is under `base` (the config file's folder) or the working directory; no
    path: responses.sqlite3 in the gateway's data folder, $GATEWAY_DATA_DIR or else ./data."""
    environ = os.environ if environ is None else environ
    if config.backend == "off":
        return None
    if config.backend == "sqlite":
        from server.gateway.conversations.sqlite import SqliteStore

        if config.path is None:
            return SqliteStore(Path(environ.get(DATA_DIR_ENV) or "data") / "responses.sqlite3")
        path = config.path if config.path.is_absolute() or base is None else base / config.path
        return SqliteStore(path)
    from server.gateway.conversations.postgres import PostgresStore

    url = environ.get(config.url_env, "")
    if not url:
        raise StoreUnavailable(
            f"responses_store.backend is postgres but the variable {config.url_env} (its URL) is not set."
        )
    return PostgresStore(url)


def check_store(config: ResponsesStore, *, environ: Mapping[str, str] | None = None, base: Path | None = None) -> None:
    """Open and close the store once, before any gateway worker starts (`serve`, `up`): a database
    that cannot be reached or migrated refuses the start once, with the reason (SettingsError),
    instead of every worker failing its start-up in the supervisor's restart loop."""

    async def check() -> None:
        store = open_store(config, environ=environ, base=base)
        if store is None:
            return
        try:
            await store.open()
        finally:
            await store.close()

    try:
        asyncio.run(check())
    except StoreUnavailable as exc:
        raise SettingsError(exc.message) from None
