"""The gateway in front of the session's real vLLM engine (tiny-cpu: tool calling on, trimming on),
with a record of every chat request the gateway sent on to the engine, to see what trimming kept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from server.deploy.plan import served_model
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.support import serve_in_thread


@dataclass
class AgentGateway:
    url: str
    model: str
    sent: list[dict[str, Any]] = field(default_factory=list)  # chat bodies as the engine got them

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def metric(self, name: str) -> float:
        """The value of one sample of the gateway's /metrics (0 when absent)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if f'model="{self.model}"' in line or "{" not in line:
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def closing_client_on_shutdown(app: Any, client: httpx.AsyncClient) -> Any:
    """The app, closing the injected client in the server's own loop when it shuts down (the
    gateway closes only the clients it made)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def send_then_close(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await client.aclose()
            await send(message)

        return await app(scope, receive, send_then_close)

    return wrapped


@pytest.fixture(scope="package")
def agent_gateway(real_engine) -> Iterator[AgentGateway]:
    gateway = AgentGateway(url="", model=real_engine.model)

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/chat/completions":
            gateway.sent.append(json.loads(request.content))

    profile = real_engine.profile
    assert profile.trimming.mode == "auto"
    models = [served_model(real_engine.model, [real_engine.url], profile, trimming=profile.trimming)]
    client = httpx.AsyncClient(
        limits=httpx.Limits(max_keepalive_connections=0),  # nothing left open
        event_hooks={"request": [record]},
    )
    app = create_app(GatewaySettings(), models, http_client=client, registry=CollectorRegistry())
    with serve_in_thread(closing_client_on_shutdown(app, client)) as url:
        gateway.url = url
        yield gateway


@pytest.fixture
def client(agent_gateway) -> Iterator[openai.OpenAI]:
    with agent_gateway.client() as client:
        yield client
