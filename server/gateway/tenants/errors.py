"""What the tenants layer refuses, in the gateway's one error hierarchy (server.gateway.errors).

GatewayError
├── ModelNotAllowed    403  invalid_request_error  model_not_allowed
└── QuotaExceeded      429  rate_limit_error       rate_limit_exceeded (Retry-After when waiting helps)
"""

from __future__ import annotations

from collections.abc import Iterable

from server.gateway.errors import GatewayError, echo


class ModelNotAllowed(GatewayError):
    """The caller's tenant may not use the model it named (its `models` allow-list)."""

    status = 403
    type = "invalid_request_error"
    code = "model_not_allowed"

    def __init__(self, tenant: str, model: str) -> None:
        super().__init__(f"Tenant `{tenant}` may not use the model `{echo(model)}`.", param="model")


class QuotaExceeded(GatewayError):
    """A tenant's requests, tokens or concurrent requests are over its limit for now."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message, headers=headers)
