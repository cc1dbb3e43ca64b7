"""The table of proxied endpoints: adding one is one entry here.

Each entry says where the endpoint lives, how the gateway finds the model a request is for,
whether it may answer as a stream, which body checks the gateway makes before routing (the
engine validates the rest and its own errors pass through), and whether history trimming
applies. The router serves every POST in this table through the same steps (request id,
auth, body read once, checks, trimming, proxy), so a new endpoint gets auth, request ids,
timeouts, retries, disconnect aborts, the error envelope and metrics without more code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.gateway.edge.checks import check_messages, check_prompt

BodyCheck = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One OpenAI-compatible endpoint the gateway forwards to an engine."""

    name: str  # metrics label and log field
    path: str  # the same path on the gateway and on the engine
    check: BodyCheck | None = None  # raises InvalidRequest for a body the gateway cannot route
    streams: bool = True  # `"stream": true` answers with server-sent events
    trims_history: bool = False  # history trimming may shorten `messages`


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", check=check_messages, trims_history=True),
    Endpoint("completions", "/v1/completions", check=check_prompt),
)

BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS}
BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}
