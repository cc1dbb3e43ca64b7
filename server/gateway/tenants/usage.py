"""What each tenant used, per model and per minute, for `GET /admin/usage?since=...`.

Rows are kept per wall-clock minute (UTC epoch minutes) for `RETENTION_MINUTES`, so `since` is
exact to the minute: a request counts from the start of the minute it ended in. This process's
own requests only: with `--workers N` each worker keeps its own ledger (the Prometheus counters
`gateway_tenant_*` are summed over every worker). No I/O; the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

RETENTION_MINUTES = 24 * 60


@dataclass(slots=True)
class UsageRow:
    """One tenant's use of one model over some minutes."""

    requests: dict[int, int] = field(default_factory=dict)  # by HTTP status
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: UsageRow) -> None:
        for status, count in other.requests.items():
            self.requests[status] = self.requests.get(status, 0) + count
        self.prompt_tokens += other.prompt_tokens
        self.cached_prompt_tokens += other.cached_prompt_tokens
        self.completion_tokens += other.completion_tokens


class UsageLedger:
    """Per-minute usage rows by (tenant, model) (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.time, retention_minutes: int = RETENTION_MINUTES) -> None:
        self.clock = clock
        self.retention = retention_minutes
        self.started = clock()
        self._minutes: dict[int, dict[tuple[str, str], UsageRow]] = {}

    def record(self, tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None:
        """One request of `tenant` for `model` ended with `status`, using these tokens."""
        minute = int(self.clock() // 60)
        rows = self._minutes.get(minute)
        if rows is None:
            rows = self._minutes[minute] = {}
            for old in [m for m in self._minutes if m <= minute - self.retention]:
                del self._minutes[old]
        row = rows.get((tenant, model))
        if row is None:
            row = rows[tenant, model] = UsageRow()
        row.requests[status] = row.requests.get(status, 0) + 1
        row.prompt_tokens += prompt
        row.cached_prompt_tokens += cached
        row.completion_tokens += completion

    def since(self, start: float | None = None) -> dict[tuple[str, str], UsageRow]:
        """Usage summed over the minutes from the one `start` (epoch seconds) falls in; None: all kept."""
        first = int(start // 60) if start is not None else None
        out: dict[tuple[str, str], UsageRow] = {}
        for minute, rows in self._minutes.items():
            if first is not None and minute < first:
                continue
            for key, row in rows.items():
                total = out.get(key)
                if total is None:
                    total = out[key] = UsageRow()
                total.add(row)
        return out
