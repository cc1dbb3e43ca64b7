"""What the flow gate refuses, in the gateway's one error hierarchy (server.gateway.errors).

GatewayError
└── QueueRefused   429  rate_limit_error  queue_full | queue_timeout | queue_displaced  (Retry-After)

No engine serving the model is not the queue's to say: the request goes on and routing answers
503 (errors.NoEngineAvailable), as it does without the gate.
"""

from __future__ import annotations

from server.gateway.errors import GatewayError


class QueueRefused(GatewayError):
    """The engines are full and this request cannot wait for them (its class's queue is full, it
    waited its class's limit, or a request of a higher class took its place): retry later."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, code: str, retry_after: int) -> None:
        super().__init__(message, code=code, headers=[(b"retry-after", str(retry_after).encode())])
        self.retry_after = retry_after
