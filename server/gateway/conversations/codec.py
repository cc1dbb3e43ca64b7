"""A `StoredResponse` as a row and back: the indexed columns, and the rest as one JSON document."""

from __future__ import annotations

from typing import Any

from server.gateway.conversations.records import StoredResponse
from server.gateway.jsonio import dumps, loads

COLUMNS = "tenant, id, previous_response_id, model, status, created_at, expires_at, record"


def to_row(response: StoredResponse) -> dict[str, Any]:
    document = {
        "input_items": response.input_items,
        "output_items": response.output_items,
        "response": response.response,
        "instructions": response.instructions,
        "tools": response.tools,
        "usage": response.usage,
    }
    return {
        "tenant": response.tenant,
        "id": response.id,
        "previous_response_id": response.previous_response_id,
        "model": response.model,
        "status": response.status,
        "created_at": response.created_at,
        "expires_at": response.expires_at,
        "record": dumps(document).decode(),
    }


def from_row(row: tuple[Any, ...]) -> StoredResponse:
    tenant, response_id, previous, model, status, created_at, expires_at, record = row
    document = loads(record)
    return StoredResponse(
        id=response_id,
        tenant=tenant,
        model=model,
        status=status,
        input_items=document["input_items"],
        output_items=document["output_items"],
        response=document["response"],
        previous_response_id=previous,
        instructions=document.get("instructions"),
        tools=document.get("tools"),
        usage=document.get("usage"),
        created_at=created_at,
        expires_at=expires_at,
    )
