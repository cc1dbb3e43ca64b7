"""One set of quota counters for every worker of `--workers N` on a host: a file they all map.

The supervisor creates the file (`create_host_file`: zeros, a header, in its own run directory)
before it starts the workers; each worker maps it (`HostCounters.open`) with its index as its
row. Layout, little-endian:

    header     8 bytes magic, u32 tenants, u32 rows (workers)              64 bytes
    buckets    per tenant 4 doubles: requests level, time, tokens level, time (tenants.counters)
    in flight  per tenant one i64 per row: that worker's requests in flight

A decision is `flock(LOCK_EX)` on the file, `decide` on the mapped doubles, the worker's own
in-flight cell incremented, unlock: a few microseconds, no process in between (bench/quota_bench.py).
The clock is CLOCK_MONOTONIC, one clock for every process of the host.

A worker that dies mid-request (SIGKILL, out of memory) cannot give its slots back, so each
worker holds an open-file-description lock on one byte of its own (past the end of the file,
`LIVE_BASE + row`) while it lives; the kernel drops it when the process dies. When a tenant's
requests in flight reach `max_concurrent`, before refusing, the deciding worker asks the kernel
(F_OFD_GETLK) whether each other row holding slots still has its owner: a row without one is
zeroed, its slots back. So a dead worker's slots are free from the next request that needs them
on; its replacement (same index, same row) zeroes the row again when it opens the file.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Sequence

from server.gateway.settings import GatewaySettings
from server.gateway.tenants.counters import OK, Clock, Limits, Outcome, State, decide, levels, refill, settle

QUOTA_FILE_ENV = "GATEWAY_QUOTA_FILE"  # set by the supervisor for its workers: the file's path
WORKER_INDEX_ENV = "GATEWAY_WORKER_INDEX"  # set for each worker: its index, its row in the file
MAGIC = b"GWQUOTA1"
HEADER = struct.Struct("<8sII")
HEADER_SIZE = 64
BUCKETS = struct.Struct("<4d")
CELL = struct.Struct("<q")
LIVE_BASE = 1 << 40  # byte offsets of the liveness locks: past any file's end (never read or written)
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86_64 and aarch64 (l_pid 0 for OFD locks)


class HostFileError(RuntimeError):
    """The counters file cannot be used (absent, not ours, or another live worker holds the row)."""


def file_size(tenants: int, rows: int) -> int:
    return HEADER_SIZE + tenants * BUCKETS.size + tenants * rows * CELL.size


def create_host_file(path: str, tenants: int, rows: int) -> str:
    """A zeroed counters file for `tenants` (in config order) and `rows` workers; `path` back."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, file_size(tenants, rows))
        os.pwrite(fd, HEADER.pack(MAGIC, tenants, rows), 0)
        never = BUCKETS.pack(0.0, -1.0, 0.0, -1.0)  # never touched: full (tenants.counters.State)
        for index in range(tenants):
            os.pwrite(fd, never, HEADER_SIZE + index * BUCKETS.size)
    finally:
        os.close(fd)
    return path


def host_quota_env(settings: GatewaySettings, run_dir: str, workers: int) -> dict[str, str]:
    """For a supervisor of `workers`: the counters file made in its `run_dir`, as the variable its
    workers find it by; nothing when no tenant has limits or the counters are in Redis."""
    tenants = settings.tenants or []
    if settings.quota_store.backend != "local" or not any(Limits.of(t.limits).any for t in tenants):
        return {}
    return {QUOTA_FILE_ENV: create_host_file(os.path.join(run_dir, "quota.counters"), len(tenants), workers)}


def _lock_range(fd: int, command: int, kind: int, start: int) -> int:
    """An OFD lock request on one byte; the lock type the kernel answers (F_OFD_GETLK)."""
    answer = fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
    return int(_FLOCK.unpack(answer)[0])


class HostCounters:
    """The counters file of this host's workers, mapped by one of them (see the module doc)."""

    def __init__(self, path: str, names: Sequence[str], row: int, clock: Clock = time.monotonic) -> None:
        try:
            self.fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise HostFileError(f"quota counters file {path}: {exc.strerror}") from None
        try:
            magic, tenants, rows = HEADER.unpack(os.pread(self.fd, HEADER.size, 0))
            if magic != MAGIC or tenants != len(names) or not 0 <= row < rows:
                raise HostFileError(
                    f"quota counters file {path}: made for {tenants} tenants and {rows} workers, "
                    f"not {len(names)} tenants and worker {row}"
                )
            try:
                _lock_range(self.fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, LIVE_BASE + row)
            except OSError:
                raise HostFileError(f"quota counters file {path}: worker {row} is alive in another process") from None
            self.map = mmap.mmap(self.fd, file_size(tenants, rows))
        except BaseException:
            os.close(self.fd)
            raise
        self.path, self.row, self.clock = path, row, clock
        self.rows: int = rows
        self.index = {name: i for i, name in enumerate(names)}
        self._cells = struct.Struct(f"<{rows}q")
        self._in_flight_base: int = HEADER_SIZE + tenants * BUCKETS.size
        with self._locked():
            for index in range(tenants):  # this row's previous owner is dead: its slots are void
                CELL.pack_into(self.map, self._cell(index, row), 0)

    def _cell(self, index: int, row: int) -> int:
        return self._in_flight_base + (index * self.rows + row) * CELL.size

    def _locked(self) -> _Flock:
        return _Flock(self.fd)

    def take_now(self, key: str, limits: Limits, reserve: int) -> Outcome:
        index = self.index[key]
        at = HEADER_SIZE + index * BUCKETS.size
        row_base = self._cell(index, 0)
        with self._locked():
            state: State = list(BUCKETS.unpack_from(self.map, at))
            in_flight = sum(self._cells.unpack_from(self.map, row_base)) if limits.concurrent else 0
            if limits.concurrent and in_flight >= limits.concurrent:
                in_flight -= self._reclaim(index)
            outcome = decide(state, limits, reserve, in_flight, self.clock())
            BUCKETS.pack_into(self.map, at, *state)
            if outcome.verdict == OK:
                mine = self._cell(index, self.row)
                CELL.pack_into(self.map, mine, CELL.unpack_from(self.map, mine)[0] + 1)
        return outcome

    async def take(self, key: str, limits: Limits, reserve: int) -> Outcome:
        return self.take_now(key, limits, reserve)

    def release(self, key: str, limits: Limits, slot: object, delta: int | None) -> None:
        index = self.index[key]
        at = HEADER_SIZE + index * BUCKETS.size
        mine = self._cell(index, self.row)
        with self._locked():
            CELL.pack_into(self.map, mine, max(0, CELL.unpack_from(self.map, mine)[0] - 1))
            if delta is not None and limits.tokens:
                state: State = list(BUCKETS.unpack_from(self.map, at))
                settle(state, limits, delta, self.clock())
                BUCKETS.pack_into(self.map, at, *state)

    def peek(self, key: str, limits: Limits) -> tuple[float, float]:
        index = self.index[key]
        with self._locked():
            state: State = list(BUCKETS.unpack_from(self.map, HEADER_SIZE + index * BUCKETS.size))
        refill(state, limits, self.clock())
        return levels(state, limits)

    def in_flight(self, key: str) -> int:
        """The tenant's requests in flight in every row (dead workers' included until reclaimed)."""
        with self._locked():
            cells: tuple[int, ...] = self._cells.unpack_from(self.map, self._cell(self.index[key], 0))
            return sum(cells)

    def _reclaim(self, index: int) -> int:
        """Zero the rows of dead workers (under the lock); the slots of tenant `index` freed."""
        freed = 0
        for row in range(self.rows):
            if row == self.row or not CELL.unpack_from(self.map, self._cell(index, row))[0]:
                continue
            if _lock_range(self.fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, LIVE_BASE + row) != fcntl.F_UNLCK:
                continue  # its worker lives
            freed += CELL.unpack_from(self.map, self._cell(index, row))[0]
            for tenant in range(len(self.index)):
                CELL.pack_into(self.map, self._cell(tenant, row), 0)
        return freed

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            self.map.close()
            os.close(self.fd)  # the liveness lock goes with it
            self.fd = -1


class _Flock:
    """`with`: an exclusive flock on the counters file (the kernel drops it if the holder dies)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
