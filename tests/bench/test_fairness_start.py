"""bench/fairness.py waits for every gateway worker only where there is a supervisor to say so."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fairness import every_worker_started
from bench.procs import Started


def started(tmp_path: Path, log_text: str) -> Started:
    log = tmp_path / "gateway.log"
    log.write_text(log_text)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return Started("gateway", [], process, log)


ONE_WORKER_LOG = '{"msg":"gateway on http://127.0.0.1:1/v1 serving tiny (1 engine)"}\n'


def test_one_worker_has_no_supervisor_line_and_is_not_waited_for(tmp_path):
    gateway = started(tmp_path, ONE_WORKER_LOG)
    try:
        asyncio.run(asyncio.wait_for(every_worker_started(gateway, 1, timeout=300), 30))
    finally:
        gateway.process.kill()
        gateway.process.wait()


def test_two_workers_wait_for_the_supervisors_line(tmp_path):
    gateway = started(tmp_path, ONE_WORKER_LOG)
    try:
        with pytest.raises(RuntimeError, match="did not all start"):
            asyncio.run(every_worker_started(gateway, 2, timeout=0.2))
        gateway.log.write_text(
            ONE_WORKER_LOG + "gateway on http://127.0.0.1:1/v1 serving tiny with 2 workers (pids 1, 2)\n"
        )
        asyncio.run(asyncio.wait_for(every_worker_started(gateway, 2, timeout=300), 30))
    finally:
        gateway.process.kill()
        gateway.process.wait()
