"""What happened to one proxied request, and the one place that reports it: metrics and access log.

The router opens a `RequestRecord` when a request arrives; the proxy fills in the engine,
status, timings and usage; `RequestReporter.finish` turns it into metrics and one access-log
line on every path, whatever the engine said (bookkeeping never raises on an engine's numbers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from server.gateway.replicas.scoring import Decision

log = logging.getLogger("gateway")

# The metrics label of requests refused before a served model was known: no model read yet (bad
# JSON, a failed API key: that body is not read), or a name nobody serves (never a label itself).
UNKNOWN_MODEL = "_unknown"
CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection"; logs and metrics only
# The error of a stream cut because its client stopped reading (logged with CLIENT_CLOSED): a
# deadline passed while the gateway waited to hand the client a chunk, not while it waited for the
# engine (that is the engine's idle timeout, a 504-style error event in the stream).
CLIENT_STALLED = "client_stalled"
_NO_FIELDS: dict[str, Any] = {}
Tokens = tuple[int | None, int | None, int]  # prompt, completion, cached prompt (RequestRecord.tokens)
NO_TOKENS: Tokens = (None, None, 0)


class RequestMetrics(Protocol):
    """The part of GatewayMetrics a request reports to (tests may pass their own)."""

    def request_started(self, model: str) -> None: ...
    def request_finished(self, model: str, code: int, duration_s: float, streamed: bool) -> None: ...
    def first_token(self, model: str, seconds: float) -> None: ...
    def inter_token(self, model: str, seconds: float) -> None: ...
    def inter_token_sink(self, model: str) -> Callable[[float], None]: ...
    def usage(self, model: str, prompt_tokens: int, completion_tokens: int) -> None: ...
    def endpoint_request(self, endpoint: str, code: int) -> None: ...
    def endpoint_first_token(self, endpoint: str, seconds: float) -> None: ...
    def routing_decision(self, model: str, reason: str) -> None: ...


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome, filled in as it travels."""

    request_id: str
    endpoint: str
    arrived: float
    model: str | None = None  # a served model, once known (metrics count it from then on)
    engine: str | None = None
    status: int = 0
    stream: bool = False
    started: bool = False  # response headers went to the client
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    usage: dict[str, Any] | None = None
    error: str | None = None
    trimmed_messages: int | None = None
    trimmed_tokens: int | None = None
    routing: Decision | None = None  # why `engine` was chosen (explained only when the log line is written)
    tenant: str | None = None  # the caller's tenant (server.gateway.tenants), when the gateway has tenants
    priority: str | None = None  # its class at the flow gate (server.gateway.flow), when it passed one
    queued_s: float | None = None  # seconds it waited there
    _tokens: tuple[Any, Tokens] | None = field(default=None, init=False, repr=False)  # see `tokens`

    def tokens(self) -> Tokens:
        """(prompt, completion, cached prompt) tokens of the engine's `usage` (None: not reported;
        cached 0), read once however many books it goes into (metrics, quota, flow gate)."""
        usage = self.usage
        read = self._tokens
        if read is not None and read[0] is usage:
            return read[1]
        if isinstance(usage, dict):
            prompt, completion = token_counts(usage)
            tokens: Tokens = (prompt, completion, cached_count(usage))
        else:
            tokens = NO_TOKENS
        self._tokens = (usage, tokens)
        return tokens


def _token_count(value: object) -> int | None:
    """A usage figure the engine reported, if it is a sane one (a non-negative integer)."""
    return value if type(value) is int and value >= 0 else None


def token_counts(usage: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of a `usage` object: chat's names, or the Responses/Anthropic ones."""
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if prompt is None and completion is None:
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    return _token_count(prompt), _token_count(completion)


def cached_count(usage: dict[str, Any]) -> int:
    """Prompt tokens the engine found in its prefix cache (`prompt_tokens_details.cached_tokens`,
    Responses: `input_tokens_details`); 0 when it does not say (vLLM reports it with
    `--enable-prompt-tokens-details`)."""
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return (_token_count(details.get("cached_tokens")) or 0) if isinstance(details, dict) else 0


class TenantUsage(Protocol):
    """Where a tenant's request is booked when it ends (metrics and the usage ledger: app.factory)."""

    def __call__(self, tenant: str, model: str, status: int, prompt: int, cached: int, completion: int) -> None: ...


class RequestReporter:
    """Opens and closes the books on each request: in-flight gauge, counters, histograms, log line;
    with tenants, also the tenant's usage (`tenant_usage`, for records that carry a tenant)."""

    def __init__(
        self,
        metrics: RequestMetrics,
        log_request: Callable[..., None] | None,
        tenant_usage: TenantUsage | None = None,
    ) -> None:
        self.metrics = metrics
        self.log_request = log_request
        self.tenant_usage = tenant_usage

    def open(self, record: RequestRecord, model: str) -> None:
        """The request's model is known and served: from now on it is in flight under that label."""
        record.model = model
        self.metrics.request_started(model)

    def finish(self, record: RequestRecord) -> None:
        duration = perf_counter() - record.arrived
        prompt_tokens, completion_tokens, cached_tokens = record.tokens()
        metrics = self.metrics
        model = record.model
        if model is None:  # refused before a served model was known: counted, under one label
            model = UNKNOWN_MODEL
            metrics.request_started(model)
        try:
            if prompt_tokens is not None or completion_tokens is not None:
                metrics.usage(model, prompt_tokens or 0, completion_tokens or 0)
        finally:
            metrics.request_finished(model, record.status, duration, record.stream)
            metrics.endpoint_request(record.endpoint, record.status)
            if record.routing is not None:
                metrics.routing_decision(model, record.routing.reason)
            if record.tenant is not None and self.tenant_usage is not None:
                self.tenant_usage(
                    record.tenant,
                    model,
                    record.status,
                    prompt_tokens or 0,
                    cached_tokens,
                    completion_tokens or 0,
                )
        if self.log_request is not None:
            self.log_request(
                request_id=record.request_id,
                model=record.model,
                engine=record.engine,
                status=record.status,
                stream=record.stream,
                ttft_s=record.first_token_at - record.arrived if record.first_token_at else None,
                duration_s=duration,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                trimmed_messages=record.trimmed_messages,
                trimmed_tokens=record.trimmed_tokens,
                error=record.error,
                routing=record.routing.explain() if record.routing is not None else None,
                **({"tenant": record.tenant} if record.tenant is not None else _NO_FIELDS),
                **({"priority": record.priority, "queued_s": record.queued_s} if record.priority else _NO_FIELDS),
            )
