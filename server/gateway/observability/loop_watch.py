"""How late the gateway's event loop runs: one blocked loop delays every stream at once.

Every request of a gateway process is served by one asyncio loop. Anything that holds it (a
long synchronous call, a full garbage collection, the process descheduled on a crowded host)
delays every stream's next chunk by the same amount, and from the client's side that looks like
an engine that stalled. The watch wakes every `interval` seconds and measures how much later than
asked it woke: that lateness goes to `gateway_event_loop_lag_seconds`, and a lateness of
`warn_after` or more is logged as a warning with its size and whether a full (oldest-generation)
garbage collection ran meanwhile, so a slow turn can be placed on the gateway or away from it.

Its cost is one timer and a few dozen bytecodes every `interval` (0.1 s), none of them on a
request's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable

log = logging.getLogger("gateway.loop")

INTERVAL = 0.1  # seconds between wake-ups
WARN_AFTER = 0.25  # seconds late: logged as a warning


def full_collections() -> int:
    """How many oldest-generation garbage collections this process has run."""
    return int(gc.get_stats()[2]["collections"])


class LoopWatch:
    """Measures the running loop's lateness every `interval` seconds (`start()` to `aclose()`)."""

    def __init__(
        self, observe: Callable[[float], None], *, interval: float = INTERVAL, warn_after: float = WARN_AFTER
    ) -> None:
        self._observe = observe
        self.interval = interval
        self.warn_after = warn_after
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="event-loop-watch")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        interval, warn_after, observe = self.interval, self.warn_after, self._observe
        collections = full_collections()
        while True:
            asked = loop.time() + interval
            await asyncio.sleep(interval)
            lag = max(0.0, loop.time() - asked)
            observe(lag)
            now = full_collections()
            if lag >= warn_after:
                log.warning(
                    "the event loop ran %.0f ms late: every stream of this process waited as long (%s)",
                    lag * 1000,
                    "a full garbage collection ran meanwhile"
                    if now != collections
                    else "no full garbage collection ran meanwhile",
                )
            collections = now
