"""CPU time of a whole process tree, read from /proc (Linux), for CPU-per-chunk figures."""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from `state` on; comm may hold spaces


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and its live descendants, plus their reaped children."""
    return sum(tree_cpu_split(root))


def tree_cpu_split(root: int) -> tuple[float, float]:
    """`tree_cpu_seconds` as (user, system): the process's own code, and the kernel's work for it."""
    user = system = 0
    for pid in tree_pids(root):
        fields = _stat_fields(pid)
        if fields is not None:
            user += int(fields[11]) + int(fields[13])  # utime cutime
            system += int(fields[12]) + int(fields[14])  # stime cstime
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def cores_busy_seconds() -> dict[str, float]:
    """Busy CPU seconds per core since boot (all processes), from /proc/stat: {"cpu0": s, ...}."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            ticks = [int(value) for value in values[:8]]  # user nice system idle iowait irq softirq steal
            out[name] = (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS
    return out
