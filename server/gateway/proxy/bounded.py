"""Reading an engine's answer whole, within a cap: what a non-streamed answer may cost in memory.

A stream is relayed chunk by chunk (bounded by flow control); an answer the gateway reads whole
(non-streamed generation, embeddings, errors, an admin fan-out) is bounded here by
`limits.max_answer_bytes`: one announced larger is refused once its first read is in (an answer
that arrives in one read, the common case, is taken without looking at its headers), one that
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
    first = await response.read_chunk()
    if len(first) > limit:
        raise AnswerTooLarge(engine, limit)
    if not first:
        return first
    chunk = await response.read_chunk()
    if not chunk:
        return first  # the whole answer in one read: no headers to look at
    for name, value in response.headers:  # more is coming: how much does the engine say?
        if name.lower() == b"content-length":
            if value.strip().isdigit() and int(value) > limit:
                raise AnswerTooLarge(engine, limit)
            break
    parts = [first]
    size = len(first)
    while chunk:
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(engine, limit)
        parts.append(chunk)
        chunk = await response.read_chunk()
    return b"".join(parts)
