"""The proxy: what every proxied request shares (settings, the upstream, metrics, parsed targets).

`Proxy.forward` answers one request from one replica of its model (`exchange.Exchange`);
`Proxy.broadcast` sends an admin request to every replica (`fanout`).
"""

from __future__ import annotations

from typing import Any

from server.gateway.edge.asgi import Receive, Send
from server.gateway.edge.requests import GatewayRequest
from server.gateway.engines.engine import Engine
from server.gateway.engines.pool import ModelPool
from server.gateway.observability.record import RequestMetrics, RequestRecord
from server.gateway.proxy.exchange import Exchange, upstream_headers
from server.gateway.proxy.fanout import fan_out
from server.gateway.proxy.upstream import Upstream
from server.gateway.settings import GatewaySettings


class Proxy:
    """Forwards requests to engines; one instance per app."""

    def __init__(
        self, *, settings: GatewaySettings, upstream: Upstream, metrics: RequestMetrics, forward_auth: bool = False
    ) -> None:
        self.settings = settings
        # `post()` of UpstreamTransport (or of any httpx client through ClientUpstream): no
        # httpx.Request/Response objects on the hot path, ~100 us less per request than a client.
        self.upstream = upstream
        self.metrics = metrics
        # Only the connect limit is the client's; first byte, idle and total are our own deadlines,
        # so socket reads carry no timer of their own.
        self.connect_timeout = settings.timeouts.connect
        self.forward_auth = forward_auth  # without keys of its own, the gateway passes the client's on
        self._targets: dict[tuple[str, str], Any] = {}
        # Engine id -> the `system_fingerprint` it last sent (JSON), for streams whose usage is hidden.
        self.fingerprints: dict[str, bytes] = {}

    def target(self, engine: Engine, path: str, method: str = "POST", *, cache: bool = True) -> Any:
        """The engine's endpoint, parsed once (parsing a URL costs more than the rest of a request's set-up).

        Paths that differ per request (a response id, a query string) are parsed each time, never kept."""
        if not cache:
            return self.upstream.target(engine.url + path, method)
        key = (engine.url, path)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = self.upstream.target(engine.url + path, method)
        return target

    async def forward(
        self, request: GatewayRequest, pool: ModelPool, record: RequestRecord, receive: Receive, send: Send
    ) -> None:
        """Answer `request` from one of `pool`'s engines; refusals before the answer started are raised."""
        await Exchange(self, request, record, send).run(pool, receive)

    async def broadcast(self, request: GatewayRequest, pool: ModelPool, record: RequestRecord, send: Send) -> None:
        """Send `request` to every replica of `pool` and answer with all their outcomes (proxy.fanout)."""
        status, body = await fan_out(self, request, pool, upstream_headers(request, self.forward_auth))
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
