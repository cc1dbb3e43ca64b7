"""Fixtures of the response-store tests: a real PostgreSQL server for the module that asks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.conversations.postgres_server import PostgresServer, binaries, postgres_server


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    if binaries() is None:
        pytest.skip("PostgreSQL is not installed (/usr/lib/postgresql/*/bin): `make postgres` installs it")
    with postgres_server(tmp_path_factory.mktemp("postgres")) as server:
        yield server
