"""Process faults, for tests of whatever starts and watches an engine process (the engine
supervisor): a stand-in that dies at start-up, one that crashes after it was found healthy, and one
that leaves a grandchild in its process group, as a vLLM engine core does.

`python -m standin --exit-now | --crash-after S | --grandchild-pidfile FILE` (cli.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from typing import Any

from standin.wire import Receive, Scope, Send

EXIT_NOW_STATUS = 3
CRASH_STATUS = 1


@dataclasses.dataclass
class ProcessFaults:
    """What the stand-in's process does besides serving."""

    exit_now: bool = False  # print a fatal error and exit with EXIT_NOW_STATUS before serving
    crash_after_s: float | None = None  # exit with CRASH_STATUS this long after the first healthy /health
    grandchild_pidfile: str | None = None  # start `sleep 600` in the process group, append its pid here

    @property
    def any(self) -> bool:
        return self.exit_now or self.crash_after_s is not None or self.grandchild_pidfile is not None


def before_serving(faults: ProcessFaults) -> None:
    """Act out the start-up faults: exit at once, or leave a grandchild behind in the group."""
    print("standin starting", flush=True)
    if faults.exit_now:
        print("standin: fatal error at start-up (--exit-now)", flush=True)
        sys.exit(EXIT_NOW_STATUS)
    if faults.grandchild_pidfile:
        child = subprocess.Popen(["sleep", "600"])  # same process group: a supervisor must stop it too
        with open(faults.grandchild_pidfile, "a") as f:
            f.write(f"{child.pid}\n")


class CrashAfterHealthy:
    """ASGI wrapper: `crash_after_s` after the first /health that answered 200, the process exits
    with CRASH_STATUS at once (no shutdown, the grandchild stays), as a crashing engine does."""

    def __init__(self, app: Any, crash_after_s: float) -> None:
        self.app = app
        self.crash_after_s = crash_after_s
        self.armed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.armed or scope["type"] != "http" or scope["path"] != "/health":
            await self.app(scope, receive, send)
            return

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200 and not self.armed:
                self.armed = True
                asyncio.get_running_loop().call_later(self.crash_after_s, _crash)
            await send(message)

        await self.app(scope, receive, watch)


def _crash() -> None:
    print("standin crashing (--crash-after)", flush=True)
    os._exit(CRASH_STATUS)
