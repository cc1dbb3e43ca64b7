"""What every proxied request shares: the settings, the upstream client, metrics, parsed targets.

`Proxy` (the front door, proxy.proxy) owns one; each `Exchange` (one request to one replica) and
each fan-out (an admin request to every replica) reads it, so neither needs the front door.
"""

from __future__ import annotations

from typing import Any

from server.gateway.observability.record import RequestMetrics
from server.gateway.proxy.upstream import Upstream
from server.gateway.replicas.engine import Engine
from server.gateway.settings import GatewaySettings


class ProxyContext:
    """The state the proxied requests of one app share."""

    __slots__ = (
        "_targets",
        "connect_timeout",
        "fingerprints",
        "flow",
        "forward_auth",
        "metrics",
        "settings",
        "upstream",
    )

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        upstream: Upstream,
        metrics: RequestMetrics,
        forward_auth: bool = False,
        flow: Any = None,
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
        self.flow = flow  # the gate in front of full engines (server.gateway.flow.gate.FlowGate), or None
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
