"""The proxy's front door: `Proxy.forward` answers one request from one replica of its model
(`exchange.Exchange`); `Proxy.broadcast` sends an admin request to every replica (`fanout`).
Both work on the `ProxyContext` the proxy owns (proxy.context), never on the proxy itself.
"""

from __future__ import annotations

from typing import Any

from server.gateway.http.asgi import Receive, Send
from server.gateway.observability.record import RequestMetrics, RequestRecord
from server.gateway.proxy.context import ProxyContext
from server.gateway.proxy.exchange import Exchange
from server.gateway.proxy.fanout import fan_out
from server.gateway.proxy.headers import upstream_headers
from server.gateway.proxy.upstream import Upstream
from server.gateway.replicas.pool import ModelPool
from server.gateway.request.request import GatewayRequest
from server.gateway.settings import GatewaySettings


class Proxy:
    """Forwards requests to engines; one instance per app."""

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        upstream: Upstream,
        metrics: RequestMetrics,
        forward_auth: bool = False,
        flow: Any = None,
    ) -> None:
        self.context = ProxyContext(
            settings=settings, upstream=upstream, metrics=metrics, forward_auth=forward_auth, flow=flow
        )

    async def forward(
        self, request: GatewayRequest, pool: ModelPool, record: RequestRecord, receive: Receive, send: Send
    ) -> None:
        """Answer `request` from one of `pool`'s engines; refusals before the answer started are raised."""
        await Exchange(self.context, request, record, send).run(pool, receive)

    async def broadcast(self, request: GatewayRequest, pool: ModelPool, record: RequestRecord, send: Send) -> None:
        """Send `request` to every replica of `pool` and answer with all their outcomes (proxy.fanout)."""
        context = self.context
        status, body = await fan_out(context, request, pool, upstream_headers(request, context.forward_auth))
        record.status, record.started = status, True
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-request-id", request.request_id.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})
