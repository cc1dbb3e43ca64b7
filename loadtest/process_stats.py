"""Where a process's time went during a run: CPU, waiting for a CPU, garbage collection.

A load generator's added latency has three sources besides its own code: the garbage
collector stopping it (`GCPauses`, from `gc.callbacks`), other processes holding the CPU while
it was ready to run (the kernel's run-queue wait, `/proc/PID/schedstat`), and its own CPU
time. `ProcessSample.take(pid)` reads the last two for any process on this host (the stand-in
engine's too), so `loadtest.selfcheck` can tell the client's share from the server's and the
machine's. Linux only; elsewhere the figures are None.

`frozen_gc()` keeps the collector's pauses out of a run: measured with `loadtest.selfcheck`
(loadtest/results/client-overhead), a full collection stopped the load generator for 21-66 ms
when one happened in a run (at 256 streams, 50 or 600 requests/s), late-stamping every chunk
that arrived meanwhile; with everything allocated before the run frozen (`gc.freeze()`), no
run had a full collection.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcessSample:
    """CPU time used and run-queue wait so far (seconds), and the time of the reading."""

    at_s: float
    cpu_s: float | None
    run_queue_wait_s: float | None

    @classmethod
    def take(cls, pid: int | None = None, clock: Callable[[], float] = time.perf_counter) -> ProcessSample:
        """Read `/proc/PID/stat` and `/proc/PID/schedstat` (this process when `pid` is None)."""
        where = f"/proc/{pid or 'self'}"
        cpu = wait = None
        try:
            with open(f"{where}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            cpu = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
            with open(f"{where}/schedstat") as schedstat:
                wait = int(schedstat.read().split()[1]) / 1e9  # ns runnable but not running
        except (OSError, ValueError, IndexError):
            pass
        return cls(clock(), cpu, wait)

    def since(self, before: ProcessSample) -> dict:
        """`cpu_share` (cores) and `run_queue_wait_share` (of wall time) between two samples."""
        wall = self.at_s - before.at_s
        result: dict = {"cpu_share": None, "run_queue_wait_share": None}
        if wall <= 0:
            return result
        if self.cpu_s is not None and before.cpu_s is not None:
            result["cpu_share"] = (self.cpu_s - before.cpu_s) / wall
        if self.run_queue_wait_s is not None and before.run_queue_wait_s is not None:
            result["run_queue_wait_share"] = (self.run_queue_wait_s - before.run_queue_wait_s) / wall
        return result


class GCPauses:
    """Times every garbage collection of this process between `start()` and `stop()`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._began: float | None = None
        self.pauses_s: list[float] = []
        self.by_generation = [0, 0, 0]
        self.longest_by_generation = [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = self._clock()
        elif self._began is not None:
            pause = self._clock() - self._began
            generation = info.get("generation", 0)
            self.pauses_s.append(pause)
            self.by_generation[generation] += 1
            self.longest_by_generation[generation] = max(self.longest_by_generation[generation], pause)
            self._began = None

    def start(self) -> None:
        self.pauses_s = []
        self.by_generation = [0, 0, 0]
        self.longest_by_generation = [0.0, 0.0, 0.0]
        gc.callbacks.append(self._callback)

    def stop(self) -> dict:
        """`gc_collections`, `gc_full_collections`, `gc_pause_total_ms`, `gc_pause_max_ms`, and
        `gc_pause_max_ms_by_generation` (young, middle, full)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return {
            "gc_collections": len(self.pauses_s),
            "gc_full_collections": self.by_generation[2],
            "gc_pause_total_ms": sum(self.pauses_s) * 1000,
            "gc_pause_max_ms": max(self.pauses_s, default=0.0) * 1000,
            "gc_pause_max_ms_by_generation": [pause * 1000 for pause in self.longest_by_generation],
        }


@contextlib.contextmanager
def frozen_gc(enabled: bool = True) -> Iterator[None]:
    """Collect once, then freeze every object alive now until the block ends.

    Frozen objects are never traversed again, so the collections during the block only walk
    what the run itself allocated: no full collection over the interpreter's and the
    libraries' objects in the middle of a measurement. Nested use keeps the outer freeze.
    """
    if not enabled or gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
