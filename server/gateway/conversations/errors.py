"""What the response store refuses, in the gateway's one error hierarchy (server.gateway.errors).

GatewayError
└── StoreUnavailable   503  service_unavailable  response_store_unavailable
"""

from __future__ import annotations

from server.gateway.errors import GatewayError


class StoreUnavailable(GatewayError):
    """The response store cannot be read or written now (its database is down or locked)."""

    status = 503
    type = "service_unavailable"
    code = "response_store_unavailable"
