"""`python -m standin`: serve one stand-in engine with uvicorn, as the benches and load tests do.

    python -m standin --port 8200 --ttft-ms 20 --itl-ms 10 --tokens 32

`STANDIN_LOG_LEVEL` sets uvicorn's log level (default `warning`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from standin.app import build_app
from standin.config import StandinConfig
from standin.lifecycle import CrashAfterHealthy, ProcessFaults, before_serving

EPILOG = """\
runtime control (JSON, see the standin package's docstring):
  POST /_standin/faults     set faults, replacing the previous set ({} resets), e.g.
                            {"status": 503, "times": 2} or {"die_after_chunks": 3} or {"hold": true}
  POST /_standin/release    let every held request go on
  GET|DELETE /_standin/stats, GET|DELETE /_standin/timings
  a request body may carry "standin": {"ttft_ms": 5, "tokens": 100, ...} for that request only

environment: STANDIN_LOG_LEVEL sets uvicorn's log level (default warning).
"""


def run(config: StandinConfig, host: str = "127.0.0.1", port: int = 8200, process: ProcessFaults | None = None) -> None:
    """Serve the stand-in with uvicorn, on uvloop and httptools when they are installed; with
    `process` faults acted out around it (lifecycle.py)."""
    import uvicorn

    app: Any = build_app(config)
    if process is not None and process.any:
        before_serving(process)
        if process.crash_after_s is not None:
            app = CrashAfterHealthy(app, process.crash_after_s)
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        log_level=os.environ.get("STANDIN_LOG_LEVEL", "warning"),
        access_log=False,
        backlog=4096,
        timeout_keep_alive=60,
    )


def parser() -> argparse.ArgumentParser:
    """The command line: where to listen, what model to serve and how fast to generate."""
    defaults = StandinConfig()
    p = argparse.ArgumentParser(
        prog="python -m standin",
        description="A stand-in for a vLLM 0.32 OpenAI server: real HTTP, vLLM's JSON shapes, exact timing, faults.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8200, help="port to listen on (default: %(default)s)")
    p.add_argument("--model", default=defaults.model, help="the one model name served (default: %(default)s)")
    p.add_argument(
        "--ttft-ms",
        type=float,
        default=defaults.ttft_ms,
        help="time to the first token after the request arrived, ms (default: %(default)s)",
    )
    p.add_argument(
        "--itl-ms", type=float, default=defaults.itl_ms, help="time between tokens, ms (default: %(default)s)"
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=defaults.tokens,
        help="tokens per answer when max_tokens does not stop earlier (default: %(default)s)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=defaults.max_model_len,
        help="context length: longer prompts get vLLM's 400 (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag)",
    )
    faults = p.add_argument_group("process faults (for tests of an engine supervisor)")
    faults.add_argument(
        "--exit-now", action="store_true", help="print a fatal error and exit with status 3 before serving"
    )
    faults.add_argument(
        "--crash-after",
        type=float,
        metavar="S",
        help="exit with status 1, S seconds after the first /health answered 200",
    )
    faults.add_argument(
        "--grandchild-pidfile",
        metavar="FILE",
        help="start `sleep 600` in this process group and append its pid to FILE",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` and serve until interrupted."""
    args = parser().parse_args(argv)
    config = StandinConfig(
        model=args.model, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, tokens=args.tokens,
        max_model_len=args.max_model_len, prompt_tokens_details=args.prompt_tokens_details,
    )  # fmt: skip
    process = ProcessFaults(
        exit_now=args.exit_now, crash_after_s=args.crash_after, grandchild_pidfile=args.grandchild_pidfile
    )
    run(config, args.host, args.port, process)
