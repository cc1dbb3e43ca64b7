"""Whether the installed uvicorn is the one the seam was written for (http.seam, http.writers): the
methods and names they call or override on uvicorn's classes and modules, looked up at start.
With one that lacks any, `seam.protocol_for` serves on uvicorn's own protocol and plain ASGI
`send` instead of failing at the first request. Instance attributes cannot be looked up before a
request: tests/gateway/http/test_uvicorn_internals.py and test_head_writer.py check those.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# What the seam calls or overrides on uvicorn's classes; instance attributes are checked by the tests.
PROTOCOL_METHODS = (
    "connection_made",
    "data_received",
    "connection_lost",
    "send_400_response",
    "on_message_begin",
    "on_header",
    "on_headers_complete",
    "on_message_complete",
    "on_response_complete",
)
CYCLE_METHODS = ("send", "receive")
FLOW_METHODS = ("drain", "resume_reading", "pause_reading")
UTILS_NAMES = ("get_client_addr", "get_path_with_query_string")  # uvicorn's access line, where it is on
# What http.writers writes answer heads with, as uvicorn's `send` does (module-level names).
HEAD_NAMES = ("STATUS_LINE", "RequestResponseCycle")  # and utils' two above


def uvicorn_problems() -> list[str]:
    """What differs in the installed uvicorn from what the seam relies on ([] when nothing does)."""
    from uvicorn.protocols import utils
    from uvicorn.protocols.http import flow_control, httptools_impl

    problems = [
        f"HttpToolsProtocol.{name}" for name in PROTOCOL_METHODS if not callable(getattr(HttpToolsProtocol, name, None))
    ]
    cycle = getattr(httptools_impl, "RequestResponseCycle", None)
    problems += [f"RequestResponseCycle.{name}" for name in CYCLE_METHODS if not callable(getattr(cycle, name, None))]
    flow = getattr(flow_control, "FlowControl", None)
    problems += [f"FlowControl.{name}" for name in FLOW_METHODS if not callable(getattr(flow, name, None))]
    problems += [f"httptools_impl.{name}" for name in HEAD_NAMES if not hasattr(httptools_impl, name)]
    problems += [f"utils.{name}" for name in UTILS_NAMES if not callable(getattr(utils, name, None))]
    return problems
