"""The OpenAI endpoints the gateway forwards to engines, as one raw ASGI handler inside the app.

    client ─► GatewayApp (app.application) ─► ProxiedEndpoints.handle(endpoint, ...): request id,
              API key ─► body read once ─► GatewayRequest ─► pool and replica (request.targets:
              model, LoRA adapter, stored response) ─► steps (history trimming) ─► Proxy ─►
              transport ─► engine   (LoRA load/unload: every replica, behind the admin key)

They stay below FastAPI's request and response classes because the relay needs the connection
itself (http.seam: the spliced stream, the disconnect watch, aborting a stalled client); they are
still routes of the app (listed in /openapi.json, seen by users' middleware: app.application).
Every answer carries `x-request-id`. An exception nothing else handled becomes one logged line
and a 500 envelope, never a traceback. Every proxied request is counted and logged once,
refusals included: under the served model it named (a refusal after its `model` was read,
request.targets.served), else under `_unknown`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter

from server.gateway.app.auth import check_api_key, identify_tenant
from server.gateway.app.state import GatewayState
from server.gateway.errors import (
    ClientDisconnected,
    GatewayError,
    InternalError,
    PermissionDenied,
    send_error,
)
from server.gateway.http.asgi import Receive, Scope, Send, read_body
from server.gateway.http.seam import mark_authenticated
from server.gateway.observability.record import (
    CLIENT_CLOSED,
    RequestRecord,
    RequestReporter,
)
from server.gateway.proxy.proxy import Proxy
from server.gateway.request.endpoints import Endpoint
from server.gateway.request.ids import request_id_from
from server.gateway.request.request import GatewayRequest, output_cap, parse_request
from server.gateway.request.targets import resolve, served
from server.gateway.tenants.directory import TenantDirectory, TenantRuntime, without_claims
from server.gateway.tenants.errors import ModelNotAllowed
from server.gateway.tenants.isolation import CacheSalts
from server.gateway.tenants.quota import Ticket, reservation

log = logging.getLogger("gateway")

RequestStep = Callable[[GatewayRequest], Awaitable[None]]


class ProxiedEndpoints:
    """The handler of every proxied endpoint (see the module doc); one per app."""

    def __init__(
        self,
        *,
        state: GatewayState,
        proxy: Proxy,
        reporter: RequestReporter,
        steps: Sequence[RequestStep] = (),
        keys: list[bytes] | None = None,
        max_body_bytes: int = 32 * 2**20,
        admin_keys: list[bytes] | None = None,
        max_upload_bytes: int = 25 * 2**20,
        tenants: TenantDirectory | None = None,
        cache_salts: CacheSalts | None = None,
    ) -> None:
        self.state = state
        self.proxy = proxy
        self.reporter = reporter
        self.steps = tuple(steps)
        self.keys = keys or []
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes  # multipart uploads (audio)
        self.admin_keys = admin_keys or []  # runtime LoRA load/unload; with none, those are refused
        self.tenants = tenants  # None: no tenants, `keys` (if any) are one anonymous caller's
        self.cache_salts = cache_salts  # tenants with cache_isolation: tenant (tenants.isolation)

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send, param: str = "") -> None:
        """Answer one request for `endpoint` (`param`: the value of its path parameter, if it has one)."""
        headers = scope["headers"]
        rid = request_id_from(headers)
        id_header = [(b"x-request-id", rid.encode())]
        record = RequestRecord(rid, endpoint.name, perf_counter())
        tenant: TenantRuntime | None = None
        try:
            if endpoint.fan_out:
                self._check_admin(headers)
            elif self.tenants is None:
                check_api_key(headers, self.keys)
            else:
                tenant = identify_tenant(headers, self.tenants)
                record.tenant = tenant.name
        except GatewayError as exc:
            # Counted under no model: the body of a client without a valid key is not read.
            record.status, record.error = exc.status, exc.message
            await send_error(send, exc, id_header)
            self.reporter.finish(record)
            return
        mark_authenticated(send, keys_checked=bool(self.keys))  # its connection is let go last (http.admission)
        request: GatewayRequest | None = None
        ticket: Ticket | None = None
        try:
            limit = self.max_upload_bytes if endpoint.model_from == "form" else self.max_body_bytes
            raw = await read_body(receive, headers, limit) if endpoint.method == "POST" else b""
            request = parse_request(
                raw,
                endpoint,
                headers=headers,
                request_id=rid,
                path=scope["path"],
                query=scope.get("query_string", b""),
                param=param,
            )
            if tenant is not None and request.model and not tenant.may_use(request.model):
                raise ModelNotAllowed(tenant.name, request.model)  # before resolve: says nothing of other models
            pool = resolve(self.state.upstreams, request)
            self.reporter.open(record, request.model)
            record.stream = request.stream
            if tenant is not None:
                ticket = await self._admit(tenant, request)
            for step in self.steps:
                await step(request)
            if endpoint.fan_out:
                await self.proxy.broadcast(request, pool, record, send)
            else:
                await self.proxy.forward(request, pool, record, receive, send)
        except ClientDisconnected:
            record.status, record.error = CLIENT_CLOSED, "client disconnected"
        except GatewayError as exc:
            record.error = exc.message
            self._label(record, exc.model if exc.model is not None else request.model if request else None)
            if record.started:  # cannot happen by construction; say so loudly rather than hang
                log.error("request %s: %s after the response started", rid, exc.message)
            else:
                record.status = exc.status
                extra = id_header
                if request is not None:
                    request.sent()
                    extra = [*request.response_headers, *id_header]
                await send_error(send, exc, extra)
        except Exception:
            log.exception("unexpected error in request %s (POST %s)", rid, endpoint.path)
            record.error = "internal error"
            self._label(record, request.model if request is not None else None)
            if not record.started:
                record.status = 500
                await send_error(
                    send,
                    InternalError(f"The gateway failed unexpectedly; its log has the details under request id {rid}."),
                    id_header,
                )
        finally:
            if request is not None:
                record.trimmed_messages, record.trimmed_tokens = request.trimmed_messages, request.trimmed_tokens
            if ticket is not None:
                ticket.settle(_tokens_used(record))
            self.reporter.finish(record)

    async def _admit(self, tenant: TenantRuntime, request: GatewayRequest) -> Ticket | None:
        """The tenant's model allow-list and quota (raises ModelNotAllowed, QuotaExceeded); the
        answer gets its rate-limit headers, and the engine a body without the client's claims
        (and with the tenant's cache_salt, for an isolated tenant)."""
        json = request.endpoint.model_from == "json"  # an upload's bytes (audio) are no prompt estimate
        if json:
            request.output_cap = output_cap(request.body)  # (read once: the quota's, then the flow gate's)
        quota = tenant.quota  # (its allow-list was checked before routing: `handle`)
        ticket = None
        if quota is not None:
            reserve = reservation(request.output_cap, len(request.raw) if json else 0)
            if quota.local:  # a call, and the headers made while the engine works (GatewayRequest.sent)
                ticket = quota.take(reserve)
                request.late_headers = ticket.headers
            else:
                ticket, headers = await quota.enter(reserve)
                request.response_headers.extend(headers)
        if json:
            body = without_claims(request.body)
            if self.cache_salts is not None:
                body = self.cache_salts.body_for(tenant.name, request.endpoint.name, body or request.body) or body
            if body is not None:
                request.replace_body(body)
        return ticket

    def _label(self, record: RequestRecord, named: str | None) -> None:
        """A request refused before routing is counted under the model it named if that one is served
        (never under a name nobody serves: the label's values stay the served models and `_unknown`)."""
        if record.model is None and named and served(self.state.upstreams, named):
            self.reporter.open(record, named)

    def _check_admin(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Admin endpoints (runtime LoRA): the admin key, and refused outright when none is configured."""
        if not self.admin_keys:
            raise PermissionDenied(
                "Runtime LoRA updates through the gateway are off: give it admin keys "
                "(auth.admin_keys_env, GATEWAY_ADMIN_KEYS by default)."
            )
        check_api_key(headers, self.admin_keys)


def _tokens_used(record: RequestRecord) -> int | None:
    """What a finished request cost its tenant's tokens quota: the engine's usage; 0 for a refusal
    the engine did no work for; None (the reservation stands) when nothing says (a client that left)."""
    prompt, completion, _ = record.tokens()
    if prompt is not None or completion is not None:
        return (prompt or 0) + (completion or 0)
    if record.status >= 400 and record.status != CLIENT_CLOSED:
        return 0
    return None
