"""The response store's schema, versioned: each backend runs the migrations it has not run yet.

`schema_version` holds one row, the last version applied. A migration is a list of statements
run in one transaction with the version bump; a store newer than this gateway (a version it does
not know) is refused rather than written to. Add a migration by appending to both lists.
"""

from __future__ import annotations

SQLITE: list[list[str]] = [
    [
        """CREATE TABLE responses (
            tenant TEXT NOT NULL,
            id TEXT NOT NULL,
            previous_response_id TEXT,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL NOT NULL,
            record TEXT NOT NULL,
            PRIMARY KEY (tenant, id)
        )""",
        "CREATE INDEX responses_expiry ON responses (expires_at)",
    ],
]

POSTGRES: list[list[str]] = [
    [
        """CREATE TABLE responses (
            tenant TEXT NOT NULL,
            id TEXT NOT NULL,
            previous_response_id TEXT,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL,
            record TEXT NOT NULL,
            PRIMARY KEY (tenant, id)
        )""",
        "CREATE INDEX responses_expiry ON responses (expires_at)",
    ],
]

CURRENT = len(SQLITE)
assert len(POSTGRES) == CURRENT
