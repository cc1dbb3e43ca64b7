"""One stored response, and the pure functions the Responses routes build on.

A `StoredResponse` keeps what OpenAI keeps of a response: the request's input items,
instructions, tools and model, the tenant that made it, the output items and usage, and the
response object the client was answered with (`response`, served again by a retrieve). A
continuation (`previous_response_id`) is sent to an engine as one stateless request whose
input is the whole chain: each earlier turn's input items then output items, oldest first,
then the new input (`chain_input`). As in OpenAI's API, the earlier turns' `instructions` are
not carried over: only the new request's apply.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

RESPONSE_PREFIX = "resp_"


def new_response_id() -> str:
    return f"{RESPONSE_PREFIX}{uuid.uuid4().hex}"


@dataclass(slots=True)
class StoredResponse:
    """One response as the store keeps it; `tenant` is "" for a gateway without tenants."""

    id: str
    tenant: str
    model: str
    status: str  # completed | incomplete | failed | cancelled
    input_items: list[Any]
    output_items: list[Any]
    response: dict[str, Any]  # the response object, in OpenAI's shape
    previous_response_id: str | None = None
    instructions: Any = None
    tools: list[Any] | None = None
    usage: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    expires_at: float = 0.0


def input_items(value: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message, as OpenAI reads it)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if isinstance(value, list):
        return list(value)
    return []


def chain_input(chain: Sequence[StoredResponse], new_input: Any) -> list[Any]:
    """The whole input of a continuation: every turn of `chain` (oldest first), then `new_input`."""
    items: list[Any] = []
    for turn in chain:
        items.extend(turn.input_items)
        items.extend(turn.output_items)
    items.extend(input_items(new_input))
    return items


def input_item_id(response_id: str, index: int) -> str:
    """A stable id for an input item that came without one (OpenAI lists every item with an id)."""
    digest = hashlib.blake2b(f"{response_id}/{index}".encode(), digest_size=12).hexdigest()
    return f"msg_{digest}"


def listed_input_items(
    stored: StoredResponse, *, order: str = "desc", after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items` in OpenAI's list shape (newest first by default)."""
    items = [
        item if isinstance(item, dict) and "id" in item else {"id": input_item_id(stored.id, index), **_as_item(item)}
        for index, item in enumerate(stored.input_items)
    ]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


def _as_item(item: Any) -> dict[str, Any]:
    return dict(item) if isinstance(item, dict) else {"type": "unknown", "value": item}


def client_response(
    answer: dict[str, Any], *, response_id: str, previous: str | None, body: dict[str, Any], store: bool
) -> dict[str, Any]:
    """The response object the client gets (and a retrieve serves): the engine's, with what the
    gateway changed on the way put back (the id it chose, `store`, the previous response, the
    client's own instructions); `store` only where the engine's object has the field."""
    out = dict(answer)
    out["id"] = response_id
    if "store" in out:  # vLLM's response objects have none: the shape stays the engine's
        out["store"] = store
    out["previous_response_id"] = previous
    if "instructions" in body:
        out["instructions"] = body["instructions"]
    return out


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
