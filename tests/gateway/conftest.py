"""Gateway test fixtures: stand-in engines and gateways as real uvicorn servers on loopback.

Timing and disconnects only behave for real over sockets (in-process ASGI transports buffer whole
bodies), so every gateway and engine here is a real server in a thread of the test process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.edge.protocol import protocol_for
from server.gateway.edge.router import Gateway as GatewayApp
from server.gateway.settings import GatewaySettings, ModelEngines
from tests.standin import Standin, StandinConfig, build_app
from tests.support import serve_in_thread

# Stand-ins answer in ~10 ms unless a test needs them slower.
FAST_ENGINE = {"ttft_ms": 2.0, "itl_ms": 1.0, "tokens": 6}


@dataclass
class Engine:
    """A running stand-in engine and its runtime controls."""

    url: str
    app: Standin

    def faults(self, **faults: Any) -> None:
        httpx.post(f"{self.url}/_standin/faults", json=faults, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/_standin/stats", timeout=5).json()


@dataclass
class Gateway:
    """A running gateway."""

    url: str
    app: GatewayApp

    @property
    def state(self) -> Any:
        return self.app.state

    def engine(self, model: str, index: int = 0) -> Any:
        return self.state.upstreams.models[model].engines[index]


def fast_settings(models: dict[str, list[str]], **overrides: Any) -> GatewaySettings:
    """Settings with test-sized health checks and backoff; `overrides` as nested dicts.

    Timeouts are far beyond what a busy machine adds (a connection to a stand-in that takes over
    0.5 s there would mark it down); a test of a timeout sets its own.
    """
    data: dict[str, Any] = {
        "health": {"interval": 0.05, "timeout": 10.0, "unhealthy_after": 2, "healthy_after": 1},
        "retries": {"max_attempts": 3, "backoff": 0.01},
        "timeouts": {"connect": 10.0, "first_byte": 60.0, "idle": 60.0, "total": 120.0},
        "metrics_scrape_interval": 60.0,
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    data["models"] = [ModelEngines(name=name, urls=urls) for name, urls in models.items()]
    return GatewaySettings.model_validate(data)


@pytest.fixture
def engines() -> Iterator[Callable[..., list[Engine]]]:
    """start(n, **StandinConfig fields) -> n stand-in engines, stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(n: int = 1, **config: Any) -> list[Engine]:
            config = {**FAST_ENGINE, **config}
            out = []
            for _ in range(n):
                app = build_app(StandinConfig(**config))
                out.append(Engine(stack.enter_context(serve_in_thread(app)), app))
            return out

        yield start


@pytest.fixture
def gateway() -> Iterator[Callable[..., Gateway]]:
    """start(settings, **create_app kwargs) -> a gateway for settings.models, served on loopback,
    stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(settings: GatewaySettings, **kwargs: Any) -> Gateway:
            kwargs.setdefault("registry", CollectorRegistry())
            app = create_app(settings, plan_deployment(settings.models).served_models(), **kwargs)
            # The gateway's own connection protocol, as `serve` runs it (edge.protocol).
            return Gateway(stack.enter_context(serve_in_thread(app, http=protocol_for(settings))), app)

        yield start


def chat_body(
    content: str = "hello there", *, model: str = "standin", stream: bool = False, **extra: Any
) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
