"""A stand-in engine that also serves `POST /v1/responses` and refuses an over-long prompt there as
vLLM does: for the gateway's Responses trimming, whose budget must meet the engine's own count.

`render` turns a Responses body (`instructions` + `input`) into the chat messages vLLM would build
from it, or None for an input it cannot read; the tests pass the gateway's own renderer
(`server.gateway.trimming.history.responses_history`), so this package imports nothing of the
gateway. The messages are counted with the stand-in's rule (`count_chat_tokens`: the numbers its
`/tokenize` gives the gateway); a prompt plus `max_output_tokens` over `max_model_len` gets vLLM's
400, anything else a small `response` object whose `usage.input_tokens` is that count. Every
request body is kept in `responses`; everything else (health, models, `/tokenize`, stats) is the
stand-in's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from standin.app import Standin, build_app
from standin.config import StandinConfig
from standin.tokens import count_chat_tokens
from standin.wire import Receive, Scope, Send


class Rendered(Protocol):
    """What `render` returns: the chat messages, and whether a generation prompt follows them."""

    messages: list[dict[str, Any]]
    generation_prompt: bool


Render = Callable[[dict[str, Any]], Rendered | None]


@dataclass
class ResponsesStandin:
    """The stand-in (`standin`) plus a length-checking `/v1/responses`; `responses`: bodies seen."""

    standin: Standin
    render: Render
    responses: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, render: Render, **config: Any) -> ResponsesStandin:
        """A fast stand-in (1 ms per token, 4 tokens) with `StandinConfig` fields in `config`."""
        return cls(build_app(StandinConfig(**{"ttft_ms": 1.0, "itl_ms": 1.0, "tokens": 4, **config})), render)

    @property
    def last_input(self) -> Any:
        return self.responses[-1]["input"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) != ("POST", "/v1/responses"):
            await self.standin(scope, receive, send)
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        self.responses.append(body)
        history = self.render(body)
        if history is None:
            await _json(send, 400, _error("Unsupported input", "input"))
            return
        prompt = count_chat_tokens(history.messages, history.generation_prompt)
        answer = body.get("max_output_tokens") or 0
        limit = self.standin.config.max_model_len
        if prompt + answer > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{answer} output tokens and your prompt contains at least {prompt} input tokens, "
                f"for a total of at least {prompt + answer} tokens."
            )
            await _json(send, 400, _error(message, "input_tokens"))
            return
        await _json(
            send,
            200,
            {
                "id": body.get("request_id") or "resp_standin",
                "object": "response",
                "status": "completed",
                "model": body.get("model"),
                "output": [
                    {
                        "type": "message",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                    }
                ],
                "usage": {"input_tokens": prompt, "output_tokens": 1, "total_tokens": prompt + 1},
            },
        )


def _error(message: str, param: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


async def _json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
