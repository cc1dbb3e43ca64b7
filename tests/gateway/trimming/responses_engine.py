"""The stand-in engine (standin/) plus a `/v1/responses` that checks the prompt's length as
vLLM does, for the Responses trimming tests.

`POST /v1/responses` renders `instructions` + `input` into chat messages (as vLLM does, through
`history.responses_history`), counts them with the stand-in's own rule (`count_chat_tokens`: the
same numbers its `/tokenize` gives the gateway), and refuses with vLLM's 400 when the prompt plus
`max_output_tokens` passes `max_model_len`; otherwise it answers a small `response` object whose
`usage.input_tokens` is that count. Every request body is kept in `responses`; everything else
(health, models, `/tokenize`, stats) is the stand-in's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.gateway.trimming.history import responses_history
from standin import Standin, StandinConfig, build_app, count_chat_tokens


@dataclass
class ResponsesStandin:
    standin: Standin
    responses: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, **config: Any) -> ResponsesStandin:
        return cls(build_app(StandinConfig(**{"ttft_ms": 1.0, "itl_ms": 1.0, "tokens": 4, **config})))

    @property
    def last_input(self) -> Any:
        return self.responses[-1]["input"]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
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
        history = responses_history(body)
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


async def _json(send: Any, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def responses_conversation(turns: int, words: int = 20) -> list[dict[str, Any]]:
    """A Responses input: a developer item, then per turn a user question, and on every third turn
    a function call with its output before the assistant's answer; ends on a user question."""
    items: list[dict[str, Any]] = [{"role": "developer", "content": "rule " * 30}]
    for turn in range(turns):
        items.append({"role": "user", "content": f"question{turn} " + "w " * (words - 1)})
        if turn % 3 == 1:
            call_id = f"call_{turn}"
            items.append(
                {"type": "function_call", "call_id": call_id, "name": "search", "arguments": f"turn {turn} places"}
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": "found " * words})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer{turn} " + "w " * (words - 1)}],
            }
        )
    items.append({"role": "user", "content": "and the last question"})
    return items
