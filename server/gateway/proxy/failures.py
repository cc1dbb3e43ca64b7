"""What went wrong upstream, as the gateway's answer: one function for every stage of a request.

    stage          retried on another replica when          marks the engine down on
    connect        connection refused/reset/closed early     connect error or connect timeout
    body           the engine closed while answering         -
    first_chunk    the engine closed before its first chunk  -
    stream         never (bytes reached the client)          -

A retry happens only while nothing has reached the client. An engine's own HTTP errors are not
failures: they pass through with the engine's status and body (a 503 is retried, see proxy).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import httpx

from server.gateway.errors import GatewayError, NoEngineAvailable, UpstreamFailed, UpstreamTimeout

# Errors that say "this engine, not this request".
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Stage(Enum):
    CONNECT = "connect"  # sending the request, up to the response headers
    BODY = "body"  # reading a whole (non-streamed) answer
    FIRST_CHUNK = "first_chunk"  # reading a stream's first chunk
    STREAM = "stream"  # after the first chunk went to the client


@dataclass(frozen=True, slots=True)
class Failure:
    error: GatewayError
    retry: bool  # another replica may do better; nothing reached the client
    engine_down: str | None = None  # why the engine should be marked down, if it should


def upstream_failure(exc: httpx.HTTPError, engine: str, model: str, stage: Stage, connect_timeout: float) -> Failure:
    """The gateway's answer to `exc`, raised while talking to engine `engine` of `model` at `stage`."""
    kind = type(exc).__name__
    if stage is Stage.CONNECT:
        if isinstance(exc, httpx.ConnectTimeout):
            return Failure(
                UpstreamTimeout(
                    f"Engine {engine} of model `{model}` did not accept a connection within {connect_timeout:g} s."
                ),
                True,
                f"{kind}: {exc}",
            )
        if isinstance(exc, httpx.ConnectError):
            return Failure(
                NoEngineAvailable(f"Engine {engine} of model `{model}` is unreachable ({exc})."), True, f"{kind}: {exc}"
            )
        if isinstance(exc, RETRYABLE):
            return Failure(UpstreamFailed(f"Engine {engine} closed the connection before answering ({kind})."), True)
        if isinstance(exc, httpx.TimeoutException):
            return Failure(UpstreamTimeout(f"Engine {engine} did not answer in time ({kind})."), False)
        return Failure(UpstreamFailed(f"Engine {engine} failed: {kind}."), False)
    if stage is Stage.STREAM:
        return Failure(UpstreamFailed(f"Engine {engine} failed mid-stream ({kind})."), False)
    retry = isinstance(exc, RETRYABLE)
    if stage is Stage.BODY:
        return Failure(UpstreamFailed(f"Engine {engine} broke off its answer ({kind})."), retry)
    verb = "broke off" if retry else "failed"
    return Failure(UpstreamFailed(f"Engine {engine} {verb} before its first chunk ({kind})."), retry)
