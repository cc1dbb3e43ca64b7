"""The few checks the gateway makes on a request body before it picks an engine.

The body is parsed once. The gateway checks only what it needs to route and to answer in the
right shape (`model`, `messages`/`prompt`, `stream`, `stream_options`, `user`); everything
else is the engine's business and passes through untouched, so its own validation errors
reach the client unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from server.gateway.errors import InvalidRequest
from server.gateway.jsonio import loads

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the gateway knows about a request after validation."""

    model: str
    stream: bool
    body: dict[str, Any]


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _wrong_type(param: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"`{param}` must be {expected}, got {_type_name(value)}.", param=param,
                          code="invalid_type")


def _missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: `{param}`.", param=param,
                          code="missing_required_parameter")


def parse_request(raw: bytes, endpoint: Endpoint) -> ParsedRequest:
    """Validate a chat or completions body; raises InvalidRequest with the OpenAI `param`."""
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {_type_name(body)}.",
                             code="invalid_json")

    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if not model:
        raise InvalidRequest("`model` must not be empty.", param="model", code="invalid_value")

    if endpoint == "chat":
        messages = body.get("messages")
        if messages is None:
            raise _missing("messages")
        if not isinstance(messages, list):
            raise _wrong_type("messages", "an array of message objects", messages)
        if not messages:
            raise InvalidRequest("`messages` must contain at least one message.", param="messages",
                                 code="invalid_value")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _wrong_type(f"messages[{i}]", "an object", message)
            if not isinstance(message.get("role"), str):
                raise InvalidRequest(f"`messages[{i}].role` must be a string.", param=f"messages[{i}].role",
                                     code="invalid_type")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise _missing("prompt")
        if not isinstance(prompt, (str, list)):
            raise _wrong_type("prompt", "a string or an array", prompt)
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequest("`prompt` must not be an empty array.", param="prompt", code="invalid_value")

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)

    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _wrong_type("stream_options", "an object", options)
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise _wrong_type("stream_options.include_usage", "a boolean", include)

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _wrong_type("user", "a string", user)

    return ParsedRequest(model=model, stream=stream, body=body)
