"""The headers of a proxied request on its way to an engine, and of the engine's answer on its way back.

An engine gets the body's type, the request id, `accept` and (only when the gateway has no keys
of its own) the client's `authorization`; nothing else of the client's headers. Its answer's
headers reach the client without those that describe the engine's connection.
"""

from __future__ import annotations

from server.gateway.http.asgi import Headers
from server.gateway.request.request import GatewayRequest

# Response headers that describe the engine's connection, not the answer.
DROPPED_RESPONSE_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"date",
        b"server",
        b"proxy-authenticate",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"x-request-id",
    }
)


def upstream_headers(request: GatewayRequest, forward_auth: bool) -> Headers:
    """The headers an engine gets: the body's type, the request id, and the client's key when we have none."""
    headers = [
        (b"content-type", request.content_type),
        (b"x-request-id", request.request_id.encode()),
        (b"accept-encoding", b"identity"),
    ]
    accept = request.header(b"accept")
    headers.append((b"accept", accept.encode("latin-1") if accept else b"*/*"))
    if forward_auth:
        auth = request.header(b"authorization")
        if auth:
            headers.append((b"authorization", auth.encode("latin-1")))
    return headers
