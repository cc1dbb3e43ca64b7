"""The stand-in's own control surface under `/_standin/`: faults, held requests, stats, timings.

- `POST /_standin/faults` replaces the fault set (`{}` resets; keys in `config.FAULT_KEYS`), and
  `times` makes the faults apply to that many generation requests, then reset themselves.
- `POST /_standin/release` lets every held request go on (its timing starts then) and clears `hold`.
- `GET/DELETE /_standin/stats`: counters since the start or the last reset (see `stats`).
- `GET/DELETE /_standin/timings`: engine-side timings of recent generation requests, by request id,
  on `time.perf_counter()`'s clock (the last `TIMINGS_KEPT` requests).

`Controls` is mixed into `Standin` (app.py): the endpoints change the engine's own state.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

from standin.config import FAULT_KEYS, TIMINGS_KEPT
from standin.wire import ApiError, read_body, send_error, send_json


class Controls:
    """Faults, held requests, counters and timings of one stand-in engine, and their endpoints."""

    faults: dict[str, Any]
    timings: collections.OrderedDict[str, dict]
    _release: asyncio.Event | None

    def _reset_stats(self) -> None:
        """Zero every counter (`DELETE /_standin/stats`, and at the start)."""
        self.running = 0
        self.peak_running = 0
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.rejected = 0
        self.died = 0
        self.held = 0
        self.tokenize_calls = 0
        self.requests: collections.Counter[str] = collections.Counter()
        self.last_request: dict | None = None
        self.last_tokenize: dict | None = None

    def stats(self) -> dict:
        """What `GET /_standin/stats` answers: `aborted` counts clients that left before the
        response finished, `rejected` error answers, `died` the `die_after_chunks` drops."""
        return {
            "running": self.running,
            "peak_running": self.peak_running,
            "started": self.started,
            "finished": self.finished,
            "aborted": self.aborted,
            "rejected": self.rejected,
            "died": self.died,
            "held": self.held,
            "tokenize_calls": self.tokenize_calls,
            "requests": dict(self.requests),
            "last_request": self.last_request,
            "last_tokenize": self.last_tokenize,
        }

    # ---- endpoints -----------------------------------------------------------------------

    async def _get_stats(self, scope, receive, send) -> None:
        await send_json(send, 200, self.stats())

    async def _delete_stats(self, scope, receive, send) -> None:
        self._reset_stats()
        await send_json(send, 200, self.stats())

    async def _get_timings(self, scope, receive, send) -> None:
        await send_json(send, 200, {"clock": "perf_counter", "requests": self.timings})

    async def _delete_timings(self, scope, receive, send) -> None:
        self.timings.clear()
        await send_json(send, 200, {"clock": "perf_counter", "requests": {}})

    def _timing(self, request_id: str, arrived: float) -> dict:
        """A fresh engine-side timing entry for one request (the oldest ones are dropped)."""
        timing = {
            "arrived": arrived,
            "first_token": None,
            "last_token": None,
            "ended": None,
            "tokens": 0,
            "ttft_s": None,
        }
        self.timings[request_id] = timing
        self.timings.move_to_end(request_id)
        while len(self.timings) > TIMINGS_KEPT:
            self.timings.popitem(last=False)
        return timing

    async def _get_faults(self, scope, receive, send) -> None:
        await send_json(send, 200, self.faults)

    async def _set_faults(self, scope, receive, send) -> None:
        try:
            body = json.loads(await read_body(receive) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("faults must be a JSON object")
            unknown = sorted(set(body) - set(FAULT_KEYS))
            if unknown:
                raise ValueError(f"unknown fault keys {unknown}; known: {sorted(FAULT_KEYS)}")
            self.faults = {key: FAULT_KEYS[key](value) for key, value in body.items() if value is not None}
        except (ValueError, TypeError) as exc:
            await send_error(send, ApiError(400, str(exc)))
            return
        await send_json(send, 200, self.faults)

    async def _release_held(self, scope, receive, send) -> None:
        await read_body(receive)
        released = self.held
        self.faults = {key: value for key, value in self.faults.items() if key != "hold"}
        if self._release is not None:
            self._release.set()
            self._release = None
        await send_json(send, 200, {"released": released})

    async def _hold(self) -> None:
        if self._release is None:
            self._release = asyncio.Event()
        release = self._release
        self.held += 1
        try:
            await release.wait()
        finally:
            self.held -= 1

    def _consume_times(self) -> None:
        if "times" in self.faults:
            remaining = self.faults["times"] - 1
            self.faults = {**self.faults, "times": remaining} if remaining > 0 else {}
