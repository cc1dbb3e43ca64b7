"""The gateway's admin API, behind the admin keys (never a tenant's): usage per tenant and model.

GET /admin/usage[?since=T]   what each tenant used, per model: requests by status, prompt, cached
                             prompt and completion tokens; T in epoch seconds or ISO 8601 (UTC
                             when it has no offset), counted from the start of its minute

Mounted only when the gateway has tenants (app.factory). Without admin keys every admin route is
refused 403, as runtime LoRA is. The figures are this gateway process's (tenants.usage): with
`--workers N` use the `gateway_tenant_*` Prometheus counters, which sum every worker.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from server.gateway.app.auth import check_api_key
from server.gateway.errors import InvalidRequest, PermissionDenied, echo
from server.gateway.tenants.usage import UsageLedger


class ModelUsage(BaseModel):
    """One tenant's use of one model."""

    tenant: str
    model: str
    requests: dict[str, int]  # by HTTP status code ("200", "429", ...)
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


class UsageReport(BaseModel):
    object: Literal["usage"] = "usage"
    since: float | None  # epoch seconds of the first minute counted (None: since the process started)
    until: float
    scope: Literal["process"] = "process"  # this gateway process's requests (see the module doc)
    data: list[ModelUsage]


def parse_since(value: str | None) -> float | None:
    """`since` as epoch seconds: a number, or ISO 8601 (UTC without an offset); InvalidRequest else."""
    if value is None or not value.strip():
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidRequest(
            f"`since` must be epoch seconds or an ISO 8601 time, not {echo(value)!r}.", param="since"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def admin_router(admin_keys: list[bytes], ledger: UsageLedger) -> APIRouter:
    """The admin routes over `ledger`, each needing one of `admin_keys`."""

    def admin_key(request: Request) -> None:
        if not admin_keys:
            raise PermissionDenied(
                "The admin API is off: give the gateway admin keys (auth.admin_api_keys, or GATEWAY_ADMIN_KEYS)."
            )
        check_api_key(request.scope["headers"], admin_keys)

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_key)], tags=["admin"])

    @router.get("/usage", response_model=UsageReport, summary="Usage per tenant and model")
    async def usage(since: Annotated[str | None, Query(description="epoch seconds or ISO 8601")] = None) -> UsageReport:
        start = parse_since(since)
        rows = ledger.since(start)
        return UsageReport(
            since=(start // 60) * 60 if start is not None else None,
            until=ledger.clock(),
            data=[
                ModelUsage(
                    tenant=tenant,
                    model=model,
                    requests={str(code): count for code, count in sorted(row.requests.items())},
                    prompt_tokens=row.prompt_tokens,
                    cached_prompt_tokens=row.cached_prompt_tokens,
                    completion_tokens=row.completion_tokens,
                )
                for (tenant, model), row in sorted(rows.items())
            ],
        )

    return router
