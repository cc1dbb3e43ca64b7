"""The live progress line: requests done, rate, TTFT p50, errors.

On a terminal one line is rewritten in place a few times a second; elsewhere (CI logs, pipes)
a plain line is printed every `plain_interval_s` seconds, so logs stay readable.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from loadtest.metrics import percentile
from loadtest.records import RequestRecord


class Progress:
    """Counts finished requests of the current run and shows them; `mode` auto|tty|plain|off."""

    def __init__(
        self,
        *,
        stream: TextIO | None = None,
        mode: str = "auto",
        tty_interval_s: float = 0.25,
        plain_interval_s: float = 5.0,
    ) -> None:
        self._stream = stream or sys.stdout
        if mode == "auto":
            mode = "tty" if getattr(self._stream, "isatty", lambda: False)() else "plain"
        self.mode = mode
        self._interval = tty_interval_s if mode == "tty" else plain_interval_s
        self._task: asyncio.Task | None = None
        self._reset("", None)

    def _reset(self, label: str, total: int | None) -> None:
        self._label = label
        self._total = total
        self._done = 0
        self._errors = 0
        self._ttfts: list[float] = []
        self._started = time.perf_counter()

    def start(self, label: str, total: int | None) -> None:
        """Begin a run (`total` requests expected, or None for duration-based runs)."""
        self._reset(label, total)
        if self.mode != "off":
            self._task = asyncio.ensure_future(self._tick())

    def update(self, record: RequestRecord) -> None:
        self._done += 1
        if not record.ok:
            self._errors += 1
        elif record.ttft_s is not None:
            self._ttfts.append(record.ttft_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.mode == "tty":
            self._stream.write("\r" + self.line() + "\x1b[K\n")
        elif self.mode == "plain":
            self._stream.write(self.line() + "\n")
        self._stream.flush()

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        total = f"/{self._total}" if self._total else ""
        ttft = percentile(self._ttfts[-500:], 50) * 1000 if self._ttfts else float("nan")
        return (
            f"[{self._label}] {self._done}{total} requests, {self._done / elapsed:.2f} req/s, "
            f"TTFT p50 {ttft:.0f} ms, errors {self._errors}, {elapsed:.0f} s"
        )

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self.mode == "tty":
                self._stream.write("\r" + self.line() + "\x1b[K")
            else:
                self._stream.write(self.line() + "\n")
            self._stream.flush()
