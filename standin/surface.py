"""A stand-in engine for the endpoints beyond chat, in vLLM 0.32's shapes: Responses (stored,
streamed, retrieved, cancelled), embeddings, uploads, runtime LoRA, and FastAPI's 404 for the rest.

Only what the gateway's own behaviour depends on is modelled: the response id is the body's
`request_id` (as vLLM does), stored responses live in this process's memory, `/v1/models` lists
LoRA adapters with `parent`, and `die_after_events` drops the connection mid-stream. Every request
is recorded (`requests`: method, path with query, content type, body) so tests can see where the
gateway sent what. Chat answers are a fixed "ok"; for timing, faults and token counts use the
stand-in itself (`standin.build_app`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from standin.wire import Receive, Send


@dataclass
class Seen:
    """One request as the engine received it."""

    method: str
    path: str
    content_type: str
    body: bytes


@dataclass
class SurfaceStandin:
    """The ASGI app; its adapters, stored responses and the requests it saw live on it."""

    model: str = "standin"
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> path
    deltas: tuple[str, ...] = ("Hello", " there", " traveller")
    die_after_events: int | None = None  # drop the connection after this many events of a stream
    event_delay_s: float = 0.002
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        method, path = scope["method"], scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode()
        if path not in ("/health", "/metrics", "/v1/models"):
            self.requests.append(
                Seen(method, path + ("?" + query if query else ""), headers.get("content-type", ""), body)
            )
        if (method, path) == ("GET", "/health") or (method, path) == ("GET", "/metrics"):
            await _send(send, 200, b"", "text/plain")
        elif (method, path) == ("GET", "/v1/models"):
            cards = [
                {
                    "id": self.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": 2048,
                    "permission": [],
                }
            ]
            cards += [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm",
                    "root": lora_path,
                    "parent": self.model,
                    "max_model_len": None,
                    "permission": [],
                }
                for name, lora_path in self.adapters.items()
            ]
            await _json(send, 200, {"object": "list", "data": cards})
        elif (method, path) == ("POST", "/v1/responses"):
            await self._create(json.loads(body), send)
        elif method == "GET" and path.startswith("/v1/responses/"):
            stored = self.stored.get(path.removeprefix("/v1/responses/"))
            await (_json(send, 200, stored) if stored else _not_found(send, path))
        elif method == "POST" and path.startswith("/v1/responses/") and path.endswith("/cancel"):
            stored = self.stored.get(path.removeprefix("/v1/responses/").removesuffix("/cancel"))
            await (_json(send, 200, dict(stored, status="cancelled")) if stored else _not_found(send, path))
        elif (method, path) == ("POST", "/v1/embeddings"):
            await self._embeddings(json.loads(body), send)
        elif (method, path) == ("POST", "/v1/audio/transcriptions"):
            await _json(send, 200, {"text": f"{len(body)} bytes of {headers.get('content-type', '')}"})
        elif (method, path) == ("POST", "/v1/chat/completions"):
            request = json.loads(body)
            await _json(
                send,
                200,
                {
                    "object": "chat.completion",
                    "model": request.get("model"),
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                    ],
                },
            )
        elif (method, path) == ("POST", "/v1/load_lora_adapter"):
            request = json.loads(body)
            if request["lora_name"] in self.adapters:
                await _json(send, 400, _error(f"The lora adapter '{request['lora_name']}' has already been loaded."))
            else:
                self.adapters[request["lora_name"]] = request["lora_path"]
                await _send(send, 200, f"Success: LoRA adapter '{request['lora_name']}' added.".encode(), "text/plain")
        elif (method, path) == ("POST", "/v1/unload_lora_adapter"):
            name = json.loads(body)["lora_name"]
            if self.adapters.pop(name, None) is None:
                await _json(send, 404, _error(f"The lora adapter '{name}' cannot be found.", 404))
            else:
                await _send(send, 200, f"Success: LoRA adapter '{name}' removed.".encode(), "text/plain")
        else:
            await _json(send, 404, {"detail": "Not Found"})

    async def _create(self, request: dict[str, Any], send: Send) -> None:
        previous = request.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            await _not_found(send, previous)
            return
        response_id = request.get("request_id") or f"resp_{uuid.uuid4().hex[:16]}"
        text = "".join(self.deltas)
        usage = {"input_tokens": 7, "output_tokens": len(self.deltas), "total_tokens": 7 + len(self.deltas)}
        done = {
            "id": response_id,
            "object": "response",
            "model": request.get("model"),
            "status": "completed",
            "previous_response_id": previous,
            "usage": usage,
            "output": [
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
        }
        self.stored[response_id] = done
        if not request.get("stream"):
            await _json(send, 200, done)
            return
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": dict(done, status="in_progress", usage=None, output=[])}
        ]
        events += [
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": delta,
                "logprobs": [],
            }
            for delta in self.deltas
        ]
        events.append({"type": "response.completed", "response": done})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for number, event in enumerate(events):
            if self.die_after_events is not None and number >= self.die_after_events:
                return  # mid-response: uvicorn drops the connection
            event["sequence_number"] = number
            chunk = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(self.event_delay_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _embeddings(self, request: dict[str, Any], send: Send) -> None:
        inputs = request["input"] if isinstance(request["input"], list) else [request["input"]]
        data = [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]} for i in range(len(inputs))]
        await _json(
            send,
            200,
            {
                "object": "list",
                "model": request.get("model"),
                "data": data,
                "usage": {"prompt_tokens": 2 * len(inputs), "total_tokens": 2 * len(inputs)},
            },
        )


def _error(message: str, code: int = 400) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if code == 400 else "NotFoundError",
            "param": None,
            "code": code,
        }
    }


async def _not_found(send: Send, response_id: str) -> None:
    await _json(
        send,
        404,
        {
            "error": {
                "message": f"Response with id '{response_id}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        },
    )


async def _json(send: Send, status: int, payload: Any) -> None:
    await _send(send, status, json.dumps(payload).encode(), "application/json")


async def _send(send: Send, status: int, body: bytes, content_type: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
