"""The proxied OpenAI endpoints in /openapi.json: a path item per entry of the endpoint table.

FastAPI describes its own routes; the proxied endpoints are raw ASGI (app.proxied), so their
description is built here from `request.endpoints.ENDPOINTS`: method, path, path parameter, and a
request schema for the endpoints whose bodies the gateway reads (the fields it checks or acts on;
every other field is the engine's, passed through untouched, so the schemas allow more). Answers
are the engine's: described by status, with the OpenAI error envelope for refusals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.gateway.request.endpoints import PARAM, Endpoint


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # the engine's own parameters pass through


class ModelRequest(_Open):
    """Any request routed by its `model` (the engine validates the rest)."""

    model: str = Field(description="A served model or LoRA adapter (GET /v1/models)")


class StreamOptions(_Open):
    include_usage: bool | None = None


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(ModelRequest):
    """POST /v1/chat/completions; the gateway may trim `messages` to fit the context (x-trim-status)."""

    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None


class CompletionRequest(ModelRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None


class ResponsesRequest(ModelRequest):
    """POST /v1/responses (the Responses API); `previous_response_id` continues a stored response."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False


class EmbeddingRequest(ModelRequest):
    input: str | list[str] | list[int] | list[list[int]]


class LoraAdapterRequest(ModelRequest):
    """Runtime LoRA load/unload on every replica of `model` (the admin key)."""

    lora_name: str
    lora_path: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    """Every refusal, the gateway's or an engine's: OpenAI's error envelope."""

    error: ErrorDetail


SCHEMAS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "embeddings": EmbeddingRequest,
    "load_lora_adapter": LoraAdapterRequest,
    "unload_lora_adapter": LoraAdapterRequest,
}
_TAGS = {
    "chat": "generation",
    "completions": "generation",
    "chat_batch": "generation",
    "responses": "responses",
    "responses_retrieve": "responses",
    "responses_cancel": "responses",
    "messages": "generation",
    "messages_count_tokens": "generation",
    "load_lora_adapter": "admin",
    "unload_lora_adapter": "admin",
    "transcriptions": "audio",
    "translations": "audio",
}


def _ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    schemas = components.setdefault("schemas", {})
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(endpoint: Endpoint, components: dict[str, Any]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": _ref(ErrorEnvelope, components)}}}
    responses: dict[str, Any] = {
        "200": {"description": "The engine's answer" + (" (SSE when `stream` is true)" if endpoint.streams else "")},
        "400": {"description": "Invalid request", **error},
        "401": {"description": "Missing or wrong API key", **error},
        "404": {"description": "Unknown model, adapter or stored response", **error},
        "503": {"description": "No healthy engine for the model", **error},
        "504": {"description": "The engine did not answer in time", **error},
    }
    operation: dict[str, Any] = {
        "summary": f"{endpoint.method} {endpoint.path} (proxied to an engine)",
        "operationId": f"{endpoint.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', endpoint.path.lower()).strip('_')}",
        "tags": [_TAGS.get(endpoint.name, "engine")],
        "responses": responses,
    }
    if PARAM in endpoint.path:
        operation["parameters"] = [
            {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    if endpoint.method == "POST":
        if endpoint.model_from == "form":
            body: dict[str, Any] = {
                "multipart/form-data": {"schema": {"type": "object", "required": ["model", "file"]}}
            }
        elif endpoint.model_from == "json":
            model = SCHEMAS.get(endpoint.name, ModelRequest)
            body = {"application/json": {"schema": _ref(model, components)}}
        else:
            body = {"application/json": {"schema": {"type": "object"}}}
        operation["requestBody"] = {"required": endpoint.model_from != "response_id", "content": body}
    return operation


def stored_response_paths(components: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's endpoints that only the gateway's response store answers (app.responses),
    beside those of the endpoint table (create, retrieve, cancel)."""
    error = {"content": {"application/json": {"schema": _ref(ErrorEnvelope, components)}}}
    parameter = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    refusals = {
        "401": {"description": "Missing or wrong API key", **error},
        "404": {"description": "No stored response of the caller's with this id", **error},
        "503": {"description": "The response store is unavailable", **error},
    }
    return {
        "/v1/responses/{response_id}": {
            "delete": {
                "summary": "DELETE /v1/responses/{response_id} (the gateway's response store)",
                "operationId": "delete_v1_responses_response_id",
                "tags": ["responses"],
                "parameters": [parameter],
                "responses": {
                    "200": {"description": '{"id", "object": "response.deleted", "deleted": true}'},
                    **refusals,
                },
            }
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "GET /v1/responses/{response_id}/input_items (the gateway's response store)",
                "operationId": "get_v1_responses_response_id_input_items",
                "tags": ["responses"],
                "parameters": [
                    parameter,
                    *(
                        {"name": name, "in": "query", "required": False, "schema": schema}
                        for name, schema in (
                            ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                            ("order", {"type": "string", "enum": ["asc", "desc"]}),
                            ("after", {"type": "string"}),
                        )
                    ),
                ],
                "responses": {
                    "200": {"description": "The request's input items (OpenAI's list shape)"},
                    "400": {"description": "A bad `limit` or `order`", **error},
                    **refusals,
                },
            }
        },
    }


def proxied_paths(endpoints: Iterable[Endpoint], components: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI path items for `endpoints`; the schemas they name are added to `components`."""
    paths: dict[str, Any] = {}
    for endpoint in endpoints:
        method: Literal["get", "post"] = "get" if endpoint.method == "GET" else "post"
        paths.setdefault(endpoint.path, {})[method] = _operation(endpoint, components)
    return paths
