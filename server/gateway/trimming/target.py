"""What history trimming needs to know about a served model, from the gateway's view of it.

`HistoryTrimming` (server.gateway.trimming.step) asks `lookup(model)` for a target with
the model's context length, its trimming settings and a token counter. The count comes from
the engine itself: vLLM's `/tokenize` with `messages` applies the model's own chat template.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import httpx

from server.config import TrimmingConfig
from server.gateway.replicas.pool import ModelPool
from server.gateway.trimming.core import Message


class Pools(Protocol):
    """The gateway's served models (`server.gateway.replicas.pool`), as trimming reads them."""

    @property
    def models(self) -> Mapping[str, ModelPool]: ...


class TokenizeFailed(RuntimeError):
    """No engine of the model could count the tokens (trimming then passes the request through)."""


class EngineTrimTarget:
    """A served model as a trimming target: `max_model_len`, `trimming`, `tokenize(...)`."""

    def __init__(self, pool: ModelPool, client: httpx.AsyncClient, timeout: httpx.Timeout) -> None:
        self.pool = pool
        self.client = client
        self.timeout = timeout

    @property
    def max_model_len(self) -> int | None:
        return self.pool.max_model_len

    @property
    def trimming(self) -> TrimmingConfig:
        return self.pool.trimming

    async def tokenize(
        self, messages: list[Message], add_generation_prompt: bool, tools: list[Any] | None = None
    ) -> int:
        """Tokens of `messages` rendered by the model's chat template, counted by one of its engines.
        With `tools`, the template renders the tool definitions too (as vLLM does for the request)."""
        engine = self.pool.side_engine()  # not acquire: a count is no request to route (round robin's turn)
        if engine is None:
            raise TokenizeFailed(f"no healthy engine for model {self.pool.name}")
        body: dict[str, Any] = {
            "model": self.pool.name,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            body["tools"] = tools
        try:
            response = await self.client.post(f"{engine.url}/tokenize", json=body, timeout=self.timeout)
            response.raise_for_status()
            count = response.json().get("count")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise TokenizeFailed(f"engine {engine.id}: /tokenize failed: {exc!r}") from exc
        if not isinstance(count, int):
            raise TokenizeFailed(f"engine {engine.id}: /tokenize answered without a count")
        return count


def make_lookup(
    pools: Pools, client: httpx.AsyncClient, timeout: httpx.Timeout
) -> Callable[[str], Awaitable[EngineTrimTarget | None]]:
    """`lookup(model)` for HistoryTrimming: None for an unknown model (the router answers 404)."""
    targets = {name: EngineTrimTarget(pool, client, timeout) for name, pool in pools.models.items()}

    async def lookup(model: str) -> EngineTrimTarget | None:
        return targets.get(model)

    return lookup
