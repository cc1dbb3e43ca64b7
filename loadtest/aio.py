"""The event loop the load tester runs on: uvloop when it is installed (`--loop auto`).

uvloop's loop runs callbacks and socket reads in C; in this project it is installed with
uvicorn[standard]. `asyncio` forces the standard library's loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any

LOOPS = ("auto", "uvloop", "asyncio")


def loop_name(kind: str = "auto") -> str:
    """The loop `run(..., loop=kind)` will use: "uvloop" or "asyncio"."""
    if kind not in LOOPS:
        raise ValueError(f"unknown event loop {kind!r} ({', '.join(LOOPS)})")
    if kind == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return kind


def run(coroutine: Coroutine[Any, Any, Any], loop: str = "auto") -> Any:
    """`asyncio.run(coroutine)` on the chosen loop."""
    if loop_name(loop) == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coroutine)
    return asyncio.run(coroutine)
