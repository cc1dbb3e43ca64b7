"""What one generation request will be: `plan_generation` checks a body as vLLM does and works out
everything (token counts, finish reason, timing, faults) before the first byte is sent.

The request's `"standin": {...}` keys win over the engine's faults for that request only.
"""

from __future__ import annotations

import dataclasses
import uuid

from standin.config import COMPLETIONS_DEFAULT_MAX_TOKENS, REQUEST_KEYS, StandinConfig
from standin.tokens import count_chat_tokens, count_prompt_tokens
from standin.wire import ApiError, Scope, check_messages, header, validation_error


@dataclasses.dataclass
class Generation:
    """One accepted generation request, everything computed before the first byte is sent."""

    chat: bool
    stream: bool
    include_usage: bool
    request_id: str
    prompt_tokens: int
    n_tokens: int
    finish_reason: str
    ttft_s: float
    itl_s: float
    die_after_chunks: int | None
    first_byte_delay_s: float
    stall_after_chunks: int | None
    stall_s: float
    headers: list[tuple[bytes, bytes]]
    hold: bool = False  # wait for POST /_standin/release before answering
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (when reported)


def check_model(config: StandinConfig, body: dict) -> None:
    """vLLM's 404 when the body names a model this engine does not serve."""
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {config.model}.",
            "NotFoundError", "model",
        )  # fmt: skip


def plan_generation(config: StandinConfig, scope: Scope, body: dict, chat: bool, faults: dict) -> Generation:
    """Validate a generation request like vLLM and work out what to send, or raise ApiError."""
    check_model(config, body)
    if chat:
        if "messages" not in body:
            raise validation_error("missing", "body.messages", "Field required")
        check_messages(body["messages"])
        prompt_tokens = count_chat_tokens(body["messages"], body.get("add_generation_prompt", True))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        if "prompt" not in body:
            raise validation_error("missing", "body.prompt", "Field required")
        prompt_tokens = count_prompt_tokens(body["prompt"])
        max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise validation_error("int_type", "body.max_tokens", "Input should be a valid integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise validation_error("bool_type", "body.stream", "Input should be a valid boolean")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if max_tokens is not None and max_tokens > config.max_model_len:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={config.max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    if prompt_tokens >= config.max_model_len:
        shown = min(prompt_tokens, config.max_model_len + 1)
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, your "
            f"prompt contains at least {shown} input tokens, which exceeds this limit even without "
            f"any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={shown})",
            param="input_tokens",
        )
    if config.strict_context and max_tokens is not None and prompt_tokens + max_tokens > config.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            param="input_tokens",
        )
    extension = body.get("standin") or {}
    if not isinstance(extension, dict) or set(extension) - REQUEST_KEYS:
        raise ApiError(400, f"`standin` takes an object with keys {sorted(REQUEST_KEYS)}", param="standin")
    knobs = {**faults, **extension}
    if "status" in knobs:
        raise ApiError(knobs["status"], "stand-in fault: answering with a fixed status", "StandinFault")
    natural = int(knobs.get("tokens", config.tokens))
    n_tokens = natural if max_tokens is None else min(natural, max_tokens)
    finish_reason = "length" if max_tokens is not None and max_tokens <= natural else "stop"
    stream_options = body.get("stream_options") or {}
    request_id = header(scope, b"x-request-id")
    headers = [(b"x-request-id", request_id.encode())] if request_id else []
    return Generation(
        chat=chat, stream=stream, include_usage=bool(stream and stream_options.get("include_usage")),
        request_id=request_id or uuid.uuid4().hex[:16], prompt_tokens=prompt_tokens,
        n_tokens=n_tokens, finish_reason=finish_reason,
        ttft_s=float(knobs.get("ttft_ms", config.ttft_ms)) / 1000,
        itl_s=float(knobs.get("itl_ms", config.itl_ms)) / 1000,
        die_after_chunks=knobs.get("die_after_chunks"),
        first_byte_delay_s=float(knobs.get("first_byte_delay_s", 0.0)),
        stall_after_chunks=knobs.get("stall_after_chunks"), stall_s=float(knobs.get("stall_s", 0.0)),
        headers=headers, hold=bool(knobs.get("hold", False)),
    )  # fmt: skip
