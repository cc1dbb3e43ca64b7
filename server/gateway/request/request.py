"""A proxied request, read once and parsed once: what every step after the router shares.

`parse_request` turns the body bytes into a `GatewayRequest` (or refuses them with the OpenAI
`param` named); history trimming and the proxy then work on that one object. A step that
changes the body calls `replace_body`, which serialises it once for the engine. How the model is
found depends on the endpoint (`Endpoint.model_from`): the JSON body's `model`, an upload form's
`model` field, or (retrieve/cancel of a stored response) the response id in the path, which the
router resolves to the engine that stored it (request.targets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from server.gateway.errors import InvalidRequest
from server.gateway.http.asgi import Headers, header_str
from server.gateway.jsonio import dumps, loads
from server.gateway.request.checks import check_depth, missing, type_name, wrong_type
from server.gateway.request.endpoints import Endpoint
from server.gateway.request.forms import form_fields

if TYPE_CHECKING:
    from server.gateway.replicas.engine import Engine

JSON = b"application/json"
OUTPUT_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # the newer name first; Responses'
_FORM_FIELDS = frozenset({"model", "stream"})


@dataclass(slots=True)
class GatewayRequest:
    """One request on its way to an engine."""

    endpoint: Endpoint
    model: str
    stream: bool
    body: dict[str, Any]  # the parsed JSON body
    raw: bytes  # the bytes the engine receives: the client's, or `body` re-serialised by `replace_body`
    headers: Headers = field(default_factory=list)  # the client's request headers
    request_id: str = ""
    response_headers: Headers = field(default_factory=list)  # steps add headers to the client's answer
    trimmed_messages: int | None = None  # what history trimming dropped, for the access log
    trimmed_tokens: int | None = None
    path: str = ""  # on the engine, with the query string; the endpoint's path when empty
    content_type: bytes = JSON  # sent to the engine (an upload keeps the client's, with its boundary)
    response_id: str | None = None  # retrieve/cancel: the stored response the path names
    pin: Engine | None = None  # the one replica that may answer (it stored the response asked for)
    adapter: str | None = None  # `model` names this LoRA adapter of the pool's base model
    # What can wait until the engine works on the request (`sent`): the answer's headers that
    # are made then (a tenant's rate-limit headers), and bookkeeping (the flow gate's charge).
    late_headers: Callable[[], Headers] | None = None
    late_work: Callable[[], object] | None = None
    output_cap: int | None = None  # `output_cap(body)`, read once on a tenant's path for its quota and the flow gate

    def header(self, name: bytes) -> str | None:
        return header_str(self.headers, name)

    def sent(self) -> None:
        """The engine has the request (or the answer is made without it): do the late work and add
        `late_headers` to `response_headers` (once: later calls do nothing)."""
        work, late = self.late_work, self.late_headers
        if work is not None:
            self.late_work = None
            work()
        if late is not None:
            self.late_headers = None
            self.response_headers.extend(late())

    def replace_body(self, body: dict[str, Any]) -> None:
        """Send `body` instead of what the client sent."""
        self.body = body
        self.raw = dumps(body)


def output_cap(body: dict[str, Any]) -> int | None:
    """The output the request may write as its body caps it (the first of OUTPUT_CAPS that is a
    whole number >= 0), or None (no cap, or one the engine will refuse)."""
    for name in OUTPUT_CAPS:
        value = body.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


def parse_request(
    raw: bytes,
    endpoint: Endpoint,
    *,
    headers: Headers | None = None,
    request_id: str = "",
    path: str = "",
    query: bytes = b"",
    param: str = "",
) -> GatewayRequest:
    """Parse and check a request for `endpoint`; raises InvalidRequest naming the OpenAI `param`.

    `path` and `query` are the client's (for endpoints with a path parameter, `param` is its value)."""
    headers = headers if headers is not None else []
    if endpoint.model_from == "json":
        request = _parse_json(raw, endpoint, headers, request_id)
    elif endpoint.model_from == "form":
        request = _parse_form(raw, endpoint, headers, request_id)
    else:
        request = GatewayRequest(
            endpoint=endpoint,
            model="",
            stream=False,
            body={},
            raw=raw,
            headers=headers,
            request_id=request_id,
            response_id=param,
        )
        request.stream = endpoint.streams and _query_flag(query, "stream")
        if raw.strip():
            request.content_type = (header_str(headers, b"content-type") or "application/json").encode("latin-1")
    if path and (path != endpoint.path or query):
        request.path = path + ("?" + query.decode("latin-1") if query else "")
    return request


def _query_flag(query: bytes, name: str) -> bool:
    return any(key == name and value.lower() == "true" for key, value in parse_qsl(query.decode("latin-1")))


def _parse_form(raw: bytes, endpoint: Endpoint, headers: Headers, request_id: str) -> GatewayRequest:
    """An upload: the `model` (and `stream`) form fields; the body goes to the engine as it came."""
    content_type = header_str(headers, b"content-type")
    fields = form_fields(raw, content_type, _FORM_FIELDS)
    model = fields.get("model")
    if not model:
        raise missing("model")
    stream = endpoint.streams and fields.get("stream", "").strip().lower() == "true"
    return GatewayRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        body=dict(fields),
        raw=raw,
        headers=headers,
        request_id=request_id,
        content_type=(content_type or "").encode("latin-1"),
    )


def _parse_json(raw: bytes, endpoint: Endpoint, headers: Headers, request_id: str) -> GatewayRequest:
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {type_name(body)}.", code="invalid_json")
    check_depth(body, raw=raw)

    model = body.get("model")
    if model is None:
        raise missing("model")
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    if not model:
        raise InvalidRequest("`model` must not be empty.", param="model", code="invalid_value")
    try:
        return _checked(body, raw, model, endpoint, headers, request_id)
    except InvalidRequest as exc:
        exc.model = model  # refused, but for this model: its metrics label if it is served
        raise


def _checked(
    body: dict[str, Any], raw: bytes, model: str, endpoint: Endpoint, headers: Headers, request_id: str
) -> GatewayRequest:
    """The rest of a JSON body's checks, once its model is known."""
    if endpoint.check is not None:
        endpoint.check(body)

    stream = body.get("stream")
    if stream is None or not endpoint.streams:
        stream = False
    elif not isinstance(stream, bool):
        raise wrong_type("stream", "a boolean", stream)

    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise wrong_type("stream_options", "an object", options)
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise wrong_type("stream_options.include_usage", "a boolean", include)

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise wrong_type("user", "a string", user)

    return GatewayRequest(
        endpoint=endpoint, model=model, stream=stream, body=body, raw=raw, headers=headers, request_id=request_id
    )
