"""The load tester's own added time: its timings joined with the engine's, request by request.

A server that records, per request id, when it received the request and when it wrote the first
and last token (the stand-in's `GET /_standin/timings`, see `standin/`) lets the load
tester measure itself: for the same request,

- `added TTFT` = the load tester's TTFT - the engine-side TTFT (first token written - request
  received). Both are durations on their own clocks, so no shared clock is needed. It is what the
  client adds: building and writing the request, the kernel's loopback both ways, the server's
  HTTP parsing up to its handler, and the client's reading, SSE decoding and JSON parsing of the
  first token; so it is an upper bound on the client's own share;
- `added E2E` = the load tester's E2E latency - (last token written - request received).

When both run on one host their `time.perf_counter()` is the same clock (Linux:
CLOCK_MONOTONIC), and given the run's `origin` the added TTFT splits into its two legs:
`send leg` = request received by the engine - sent by the client (the client's writing, the
kernel, and the server's own lateness in reading it), and `receive leg` = first token seen by the
client - written by the engine (the kernel, and the client's lateness in reading it).

Pure functions, except `fetch_engine_timings`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.metrics import describe
from loadtest.records import RequestRecord


@dataclass(frozen=True)
class Joined:
    """One request seen from both ends (seconds)."""

    request_id: str
    client_ttft_s: float
    engine_ttft_s: float
    client_e2e_s: float | None
    engine_e2e_s: float | None
    send_leg_s: float | None = None  # engine arrived - client sent (shared clock only)
    receive_leg_s: float | None = None  # client first token - engine first token (shared clock)

    @property
    def added_ttft_s(self) -> float:
        return self.client_ttft_s - self.engine_ttft_s

    @property
    def added_e2e_s(self) -> float | None:
        if self.client_e2e_s is None or self.engine_e2e_s is None:
            return None
        return self.client_e2e_s - self.engine_e2e_s


def join(records: Sequence[RequestRecord], engine: dict[str, dict], *, origin: float | None = None) -> list[Joined]:
    """Successful records matched with the engine's timings of the same request id.

    `engine` maps request ids to `{"arrived", "first_token", "last_token", ...}` (seconds on the
    engine's clock, as `/_standin/timings` gives them). Records without a match are left out
    (`overhead_summary` counts them). With `origin` (the run's start on a clock the engine
    shares) the two legs are filled in too.
    """
    joined = []
    for record in records:
        timing = engine.get(record.request_id)
        if not record.ok or record.ttft_s is None or not timing:
            continue
        arrived, first, last = (timing.get(k) for k in ("arrived", "first_token", "last_token"))
        if arrived is None or first is None:
            continue
        sent = None if origin is None else origin + record.sent_s
        joined.append(
            Joined(
                request_id=record.request_id,
                client_ttft_s=record.ttft_s,
                engine_ttft_s=first - arrived,
                client_e2e_s=record.e2e_s,
                engine_e2e_s=None if last is None else last - arrived,
                send_leg_s=None if sent is None else arrived - sent,
                receive_leg_s=None if sent is None else sent + record.ttft_s - first,
            )
        )
    return joined


def overhead_summary(records: Sequence[RequestRecord], engine: dict[str, dict], *, origin: float | None = None) -> dict:
    """`{median,p90,p99,mean,max}_added_{ttft,e2el}_ms`, `joined_requests`, `unjoined_requests`;
    with `origin` also `{median,p99}_{send,receive}_leg_ms`.

    Field names follow the rest of the summary (`median_ttft_ms`, ...). Only successful records
    count; an unjoined one is a success the engine has no timing for.
    """
    joined = join(records, engine, origin=origin)
    ok = sum(1 for r in records if r.ok and r.ttft_s is not None)
    result: dict = {"joined_requests": len(joined), "unjoined_requests": ok - len(joined)}
    series = {"ttft": [j.added_ttft_s for j in joined], "e2el": [e for j in joined if (e := j.added_e2e_s) is not None]}
    for name, values in series.items():
        stats = describe(values)
        for stat in ("median", "p90", "p99", "mean", "max"):
            result[f"{stat}_added_{name}_ms"] = stats.get(stat, math.nan) * 1000
    if origin is not None:
        for leg in ("send", "receive"):
            stats = describe([getattr(j, f"{leg}_leg_s") for j in joined])
            for stat in ("median", "p99"):
                result[f"{stat}_{leg}_leg_ms"] = stats.get(stat, math.nan) * 1000
    return result


async def fetch_engine_timings(url: str, http) -> dict[str, dict]:
    """The `requests` of a `/_standin/timings`-style endpoint (an httpx.AsyncClient `http`)."""
    response = await http.get(url, timeout=30.0)
    response.raise_for_status()
    return response.json()["requests"]
