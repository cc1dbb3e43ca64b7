"""The engine's tokenizer as routing asks it: a prompt's token ids from an engine's /tokenize, for
the precise prefix index (cache.py), and the leading messages' tokens remembered (tokens.py) so that
most requests need no round trip at all."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

import httpx

from server.gateway.replicas.engine import Engine
from server.gateway.replicas.tokens import LeadingTokens, leading_request, request_key

log = logging.getLogger("gateway.routing")

SHORTER_TRIES = 8  # shorter runs of leading messages looked up when a chat's whole leading part is new


class Tokenize(Protocol):
    """tokenize(model, engines, body) -> the prompt's token ids for routing, or None. `engines`: the
    healthy replicas, least loaded first (a round trip that must be answered at once goes there;
    work that can wait goes to the busiest, whose request in flight has most likely had its first
    token already). `whole`: the whole prompt's tokens, from the first engine, never remembered."""

    def __call__(
        self, model: str, engines: Sequence[Engine], body: Mapping[str, Any], whole: bool = False
    ) -> Awaitable[list[int] | None]: ...


def tokenize_request(model: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The /tokenize body that yields the token ids the engine will prefill for `body`."""
    messages = body.get("messages")
    if isinstance(messages, list):
        request: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": body.get("add_generation_prompt", True),
        }
        for key in ("tools", "continue_final_message", "chat_template_kwargs"):
            if body.get(key) is not None:
                request[key] = body[key]
        return request
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    return None


class EngineTokenizer:
    """Token ids from an engine's /tokenize; None on any failure (routing then goes approximate).

    A chat request whose leading messages (or a shorter run of them: a conversation's system prompt)
    were tokenized before is keyed from those (tokens.py), with no round trip. Only a chat that opens
    a new way is learned (a conversation's next turn never opens as this one did: learning every
    turn's opening cost the engines round trips for nothing). It goes on at once (None: approximate
    routing, which knows what this gateway sent) while its leading messages are tokenized in the
    background, with its whole prompt for a model's first openings (tokens.py checks that the one
    begins the other), on the busiest replica: the least loaded one is where this request is about
    to go, and on one CPU core each the round trips took 2-8 ms off a new tenant's first token
    there. A prompt with no leading messages (one message, or the completions API) is tokenized
    whole, before routing, as every request was before."""

    def __init__(self, client: httpx.AsyncClient, timeout: float, *, leading: LeadingTokens | None = None) -> None:
        self.client = client
        self.timeout = httpx.Timeout(timeout)
        self.leading = leading if leading is not None else LeadingTokens()
        self._learning: dict[bytes, asyncio.Task[None]] = {}  # leading-message keys being tokenized

    async def __call__(
        self, model: str, engines: Sequence[Engine], body: Mapping[str, Any], whole: bool = False
    ) -> list[int] | None:
        request = tokenize_request(model, body)
        if request is None or not engines:
            return None
        head = leading_request(request) if self.leading.usable(model) and not whole else None
        if head is None:
            return await self._tokenize(engines[0], request)
        key = request_key(head)
        known = self.leading.get(model, key)
        if known is None:
            known = self._shorter(model, request)
            if known is None and key not in self._learning:
                # On the busiest replica: the least loaded one is where this very request is about to go.
                task = asyncio.create_task(self._learn(model, engines[-1], key, request, head))
                self._learning[key] = task
                task.add_done_callback(lambda _: self._learning.pop(key, None))
        return known

    def _shorter(self, model: str, request: Mapping[str, Any]) -> list[int] | None:
        """The tokens of the longest shorter run of leading messages remembered: a conversation's
        next turn opens with its previous turns, which were never the leading part of a request, but
        its system prompt (the previous turn's leading part) was."""
        messages = request["messages"]
        for end in range(len(messages) - 2, max(0, len(messages) - 2 - SHORTER_TRIES), -1):
            known = self.leading.get(
                model, request_key({**request, "messages": messages[:end], "add_generation_prompt": False})
            )
            if known is not None:
                return known
        return None

    async def _learn(
        self, model: str, engine: Engine, key: bytes, request: Mapping[str, Any], head: Mapping[str, Any]
    ) -> None:
        try:
            if self.leading.checked(model):  # its template is known to keep openings: one round trip
                full, leading = None, await self._tokenize(engine, head)
            else:
                full, leading = await asyncio.gather(self._tokenize(engine, request), self._tokenize(engine, head))
                if full is None:
                    return
        except Exception as exc:  # nobody awaits this task: a closed client must not leave its error unread
            log.info("engine %s: background /tokenize for routing failed (%r)", engine.id, exc)
            return
        if leading is not None and not self.leading.learn(model, key, leading, full) and full is not None:
            log.warning("model %s: its chat template renders leading messages differently when more follow; "
                        "precise routing tokenizes every prompt whole", model)  # fmt: skip

    async def aclose(self) -> None:
        """Cancel the background tokenizations still running (the gateway is stopping)."""
        tasks = list(self._learning.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _tokenize(self, engine: Engine, request: Mapping[str, Any]) -> list[int] | None:
        try:
            response = await self.client.post(f"{engine.url}/tokenize", json=request, timeout=self.timeout)
            response.raise_for_status()
            tokens = response.json().get("tokens")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.info("engine %s: /tokenize for routing failed (%r); approximate routing", engine.id, exc)
            return None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        return tokens
