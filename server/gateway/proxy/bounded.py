"""Reading an engine's answer whole, within a cap: what a non-streamed answer may cost in memory.

A stream is relayed chunk by chunk (bounded by flow control); an answer the gateway reads whole
(non-streamed generation, embeddings, errors, an admin fan-out) is bounded here by
`limits.max_answer_bytes`: one announced larger is refused before a byte of it is read, one that
grows past the cap is cut there. Either way the client gets 502 `engine_answer_too_large`, the
engine's connection is closed (not pooled: the rest of the answer is still on it) and memory stays
under about twice the cap (the pieces, then the joined copy).
"""

from __future__ import annotations

from server.gateway.errors import GatewayError
from server.gateway.proxy.upstream import UpstreamResponse


class AnswerTooLarge(GatewayError):
    status = 502
    type = "upstream_error"
    code = "engine_answer_too_large"

    def __init__(self, engine: str, limit: int) -> None:
        super().__init__(
            f"Engine {engine} answered with a body larger than the gateway's limit of {limit} bytes "
            "(limits.max_answer_bytes); a long answer can be streamed instead."
        )


async def read_bounded(response: UpstreamResponse, limit: int, engine: str) -> bytes:
    """The whole body of `response`, or AnswerTooLarge past `limit` bytes (announced or counted).

    Raises what `response.read_chunk()` raises for a broken answer."""
    length = next((value for name, value in response.headers if name.lower() == b"content-length"), None)
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise AnswerTooLarge(engine, limit)
    parts: list[bytes] = []
    size = 0
    while chunk := await response.read_chunk():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(engine, limit)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
