"""The stand-in engine as one pure ASGI app: `Standin` routes vLLM's endpoints (`/health`,
`/version`, `/v1/models`, `/metrics`, `/v1/chat/completions`, `/v1/completions`, `/tokenize`) and
its own `/_standin/*` controls (control.py), and counts every generation request it takes.

A generation request is planned first (generation.py: checked as vLLM checks it, 400/404 in the
OpenAI envelope otherwise), then answered on its schedule (replies.py) while a watcher notices a
client that leaves (`http.disconnect`) and cancels the answer, counted as `aborted`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from standin.config import StandinConfig
from standin.control import Controls
from standin.generation import check_model, plan_generation
from standin.metrics import render_metrics
from standin.prefix_cache import PrefixCache
from standin.replies import respond, stream
from standin.tokens import count_chat_tokens, count_prompt_tokens
from standin.wire import (
    ApiError,
    ClientGone,
    Died,
    Receive,
    Scope,
    Send,
    check_messages,
    headers_of,
    parse_json,
    read_body,
    request_id_headers,
    send_error,
    send_json,
    watch_disconnect,
)


class Standin(Controls):
    """The ASGI app. One instance is one engine; its counters and faults live on it."""

    def __init__(self, config: StandinConfig):
        self.config = config
        self.faults: dict[str, Any] = {}
        self._reset_stats()
        self.prefix_cache = PrefixCache()
        self._kv_in_use = 0
        self._release: asyncio.Event | None = None  # what held requests wait for (made on the server's loop)
        self.timings: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._created = int(time.time())
        self._routes: dict[tuple[str, str], Callable] = {
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/tokenize"): self._tokenize,
            ("GET", "/_standin/stats"): self._get_stats,
            ("DELETE", "/_standin/stats"): self._delete_stats,
            ("GET", "/_standin/faults"): self._get_faults,
            ("POST", "/_standin/faults"): self._set_faults,
            ("POST", "/_standin/release"): self._release_held,
            ("GET", "/_standin/timings"): self._get_timings,
            ("DELETE", "/_standin/timings"): self._delete_timings,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        handler = self._routes.get((scope["method"], path))
        if handler is None:
            known = any(route_path == path for _, route_path in self._routes)
            status, detail = (405, "Method Not Allowed") if known else (404, "Not Found")
            await send_json(send, status, {"detail": detail})
            return
        try:
            await handler(scope, receive, send)
        except ClientGone:
            return  # left before its request body arrived: nothing to answer

    # ---- small endpoints -----------------------------------------------------------------

    async def _health(self, scope, receive, send) -> None:
        status = self.faults.get("health_status", 200)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _version(self, scope, receive, send) -> None:
        await send_json(send, 200, {"version": "0.32.0"})

    async def _models(self, scope, receive, send) -> None:
        model = self.config.model
        card = {
            "id": model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": self.config.max_model_len,
            "permission": [{
                "id": "modelperm-standin", "object": "model_permission", "created": self._created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }  # fmt: skip
        await send_json(send, 200, {"object": "list", "data": [card]})

    async def _metrics(self, scope, receive, send) -> None:
        usage = self.faults.get("kv_cache_usage_perc")
        if usage is None:
            usage = min(1.0, self._kv_in_use / self.config.kv_cache_tokens)
        text = self.faults.get("metrics_text")  # a page of the test's own (one captured from vLLM)
        if text is None:
            text = render_metrics(self.config, self.running, usage, self.prefix_cache)
        await send({
            "type": "http.response.start", "status": self.faults.get("metrics_status", 200),
            "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": text.encode()})

    async def _tokenize(self, scope, receive, send) -> None:
        self.tokenize_calls += 1
        try:
            body = parse_json(await read_body(receive))
            self.last_tokenize = {"path": scope["path"], "headers": headers_of(scope), "body": body}
            if "tokenize_status" in self.faults:
                raise ApiError(self.faults["tokenize_status"], "stand-in fault", "ServiceUnavailableError")
            check_model(self.config, body)
            if "messages" in body:
                check_messages(body["messages"])
                count = count_chat_tokens(body["messages"], body.get("add_generation_prompt", True))
            elif "prompt" in body:
                count = count_prompt_tokens(body["prompt"])
            else:
                raise ApiError(400, "Either `prompt` or `messages` is required.", "Bad Request", "body")
        except ApiError as exc:
            await send_error(send, exc)
            return
        result = {
            "count": count, "max_model_len": self.config.max_model_len,
            "tokens": list(range(count)), "token_strs": None,
        }  # fmt: skip
        await send_json(send, 200, result)

    # ---- generation ----------------------------------------------------------------------

    async def _chat(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _completions(self, scope, receive, send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        arrived = time.perf_counter()
        self.requests[scope["path"]] += 1
        raw = await read_body(receive)
        try:
            body = parse_json(raw)
            self.last_request = {"path": scope["path"], "headers": headers_of(scope), "body": body}
            faults = self.faults
            if faults:
                self._consume_times()
            plan = plan_generation(self.config, scope, body, chat, faults)
        except ApiError as exc:
            self.rejected += 1
            await send_error(send, exc, request_id_headers(scope))
            return
        self.started += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        kv = plan.prompt_tokens + plan.n_tokens
        self._kv_in_use += kv
        cached = self.prefix_cache.count(body)
        if self.config.prompt_tokens_details:
            plan.cached_tokens = min(cached, plan.prompt_tokens)
        timing = self._timing(plan.request_id, arrived)
        main = asyncio.current_task()
        state = {"done": False, "gone": False}
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, main, state))
        try:
            begun = arrived
            if plan.hold:
                await self._hold()
                begun = time.perf_counter()
            if plan.stream:
                await stream(send, plan, begun, body.get("model") or self.config.model, timing)
            else:
                await respond(send, plan, begun, body.get("model") or self.config.model, state)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            if main is not None:
                main.uncancel()
            self.aborted += 1
        except Died:
            self.died += 1
        else:
            if state["gone"]:
                self.aborted += 1
            else:
                self.finished += 1
        finally:
            state["done"] = True
            watcher.cancel()
            self.running -= 1
            self._kv_in_use -= kv
            timing["ended"] = time.perf_counter()


def build_app(config: StandinConfig | None = None) -> Standin:
    """The stand-in engine as a pure ASGI app (serve it with uvicorn)."""
    return Standin(config or StandinConfig())
