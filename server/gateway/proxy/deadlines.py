"""Deadlines and the client's disconnect for one proxied request: either one cancels its task.

`Deadlines` fires at most once and says why (`reason`). Before the first byte the first-byte
and total deadlines apply; once streaming, the idle and total ones. Per streamed chunk the
proxy only stores the time (`last`); the idle timer re-arms itself lazily, at most once per
idle period. The timer and the watch on the client start on the loop's next turn: by then the
request has gone out to the engine, so setting them up costs nothing on the way there. The
client's disconnect comes from its connection (http.seam.watch_disconnect) under the
gateway's own server; under another one a task waits on `receive` for `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter
from typing import Literal

from server.gateway.http.asgi import Receive, Send
from server.gateway.http.seam import watch_disconnect

Reason = Literal["first_byte", "idle", "total", "disconnect"]


class Deadlines:
    """The request's timers and disconnect watcher (see the module doc)."""

    __slots__ = (
        "task",
        "reason",
        "last",
        "_loop",
        "_handle",
        "_armed",
        "_streaming",
        "_first_byte_at",
        "_total_at",
        "_idle",
        "_watcher",
        "_unwatch",
    )

    def __init__(
        self,
        task: asyncio.Task[None],
        arrived: float,
        first_byte: float,
        idle: float,
        total: float,
        receive: Receive,
        send: Send | None = None,
    ) -> None:
        self.task = task
        self.reason: Reason | None = None
        self._loop = asyncio.get_running_loop()
        self._armed = True
        self._streaming = False
        now = perf_counter()
        self.last = now
        self._first_byte_at = now + first_byte
        self._total_at = arrived + total
        self._idle = idle
        self._handle: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None
        self._loop.call_soon(self._start, receive, send)

    def _start(self, receive: Receive, send: Send | None) -> None:
        if not self._armed:
            return
        if not self._streaming:
            self._arm(min(self._first_byte_at, self._total_at))
        if send is not None:
            self._unwatch = watch_disconnect(send, self._disconnected)
        if self._unwatch is None:
            self._watcher = self._loop.create_task(_watch_disconnect(receive, self))

    def _disconnected(self) -> None:
        self.fire("disconnect")

    def _arm(self, at: float) -> None:
        self._handle = self._loop.call_later(max(0.0, at - perf_counter()), self._check)

    def _check(self) -> None:
        if not self._armed:
            return
        now = perf_counter()
        if now >= self._total_at:
            self.fire("total")
        elif not self._streaming:
            if now >= self._first_byte_at:
                self.fire("first_byte")
            else:
                self._arm(min(self._first_byte_at, self._total_at))
        else:
            idle_at = self.last + self._idle
            if now >= idle_at:
                self.fire("idle")
            else:
                self._arm(min(idle_at, self._total_at))

    def streaming(self, now: float) -> None:
        """The first chunk went out: from now on the idle deadline applies."""
        self._streaming = True
        self.last = now
        if self._handle is not None:
            self._handle.cancel()
        self._arm(min(now + self._idle, self._total_at))

    def fire(self, reason: Reason) -> None:
        if not self._armed:
            return
        self.disarm()
        self.reason = reason
        self.task.cancel()

    def disarm(self) -> None:
        """The upstream answer is complete: nothing may cancel the request any more."""
        self._armed = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None  # the handle refers back to us: no cycle for the collector

    def close(self) -> None:
        self.disarm()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None  # the connection no longer refers to us, nor we to it
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None  # likewise (its cancelled coroutine's frame refers to us)


async def _watch_disconnect(receive: Receive, deadlines: Deadlines) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            deadlines.fire("disconnect")
            return
