"""Runtime LoRA load and unload: one admin request, sent to every replica of the model at once.

`POST /v1/load_lora_adapter {"model": BASE, "lora_name": ..., "lora_path": ...}` (and unload) goes
to each replica of BASE in parallel (vLLM needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` on the engine,
or it answers 404). The gateway answers 200 only when every replica did, with each replica's
answer:

    {"object": "lora_adapter.update", "model": BASE, "lora_name": NAME, "action": "load",
     "engines": [{"engine": "127.0.0.1:8100", "status": 200, "message": "Success: ..."}]}

otherwise the first failing replica's status, in the OpenAI envelope, naming every replica's
outcome. Replicas that succeeded route the adapter at once (replicas.adapters); the others do
not, so a partial load never sends a request to a replica without the adapter. A replica that
is down counts as failed (it will not have the adapter when it comes back: load it again).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from server.gateway.errors import GatewayError, engine_error_body
from server.gateway.jsonio import dumps
from server.gateway.proxy.bounded import AnswerTooLarge, read_bounded
from server.gateway.proxy.context import ProxyContext
from server.gateway.replicas import adapters
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import ModelPool
from server.gateway.request.request import GatewayRequest


@dataclass(frozen=True, slots=True)
class Outcome:
    engine: str
    status: int  # 0: no answer (down, unreachable)
    message: str


class FanOutFailed(GatewayError):
    """At least one replica refused; the status is the first refusing replica's."""

    type = "upstream_error"
    code = "fan_out_failed"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _message(status: int, content: bytes) -> str:
    if status == 200:
        return content.decode("utf-8", "replace").strip().strip('"')
    body = engine_error_body(status, content) or content
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content.decode("utf-8", "replace")[:500]


async def _one(
    context: ProxyContext, request: GatewayRequest, engine: Engine, headers: list[tuple[bytes, bytes]]
) -> Outcome:
    if not engine.healthy:
        return Outcome(engine.id, 0, f"engine is down ({engine.last_error or 'failed its health check'})")
    endpoint = request.endpoint
    try:
        response = await context.upstream.post(
            context.target(engine, endpoint.path),
            headers,
            request.raw,
            connect_timeout=context.connect_timeout,
            read_timeout=context.settings.timeouts.first_byte,
        )
        try:
            content = await read_bounded(response, context.settings.limits.max_answer_bytes, engine.id)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        return Outcome(engine.id, 0, f"{type(exc).__name__}: {exc}")
    except AnswerTooLarge as exc:
        return Outcome(engine.id, 502, exc.message)
    return Outcome(engine.id, response.status_code, _message(response.status_code, content))


async def fan_out(
    context: ProxyContext, request: GatewayRequest, pool: ModelPool, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """Send `request` to every replica of `pool`; (status, JSON body) of the gateway's answer."""
    outcomes = await asyncio.gather(*(_one(context, request, engine, headers) for engine in pool.engines))
    name = request.body.get("lora_name")
    loading = request.endpoint.name == "load_lora_adapter"
    if isinstance(name, str):
        path = request.body.get("lora_path")
        for engine, outcome in zip(pool.engines, outcomes, strict=True):
            if outcome.status == 200:
                if loading:
                    adapters.loaded(engine, name, path if isinstance(path, str) else None)
                else:
                    adapters.unloaded(engine, name)
    results = [{"engine": o.engine, "status": o.status, "message": o.message} for o in outcomes]
    failed = [o for o in outcomes if o.status != 200]
    if not failed:
        return 200, dumps(
            {
                "object": "lora_adapter.update",
                "model": pool.name,
                "lora_name": name,
                "action": "load" if loading else "unload",
                "engines": results,
            }
        )
    status = failed[0].status or 502
    summary = "; ".join(f"{o.engine}: {o.status or 'no answer'} {o.message}" for o in outcomes)
    error = FanOutFailed(status, f"{len(failed)} of {len(outcomes)} replicas of `{pool.name}` refused: {summary}")
    return status, dumps(error.envelope())
