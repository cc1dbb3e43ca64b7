"""The router's part around the trimming step, for tests: body read once, parsed, the step, the engine.

`StepRouter(step, app)` does for one step what `server.gateway.app.proxied.ProxiedEndpoints` does for all
of them: a POST to an endpoint of the table is read, parsed into a `GatewayRequest` and passed
to the step; a `GatewayError` becomes the OpenAI error envelope (with the request's response
headers); otherwise the request's (possibly replaced) bytes go to `app` and the step's response
headers join the answer. Everything else goes to `app` untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from server.gateway.errors import GatewayError, send_error
from server.gateway.http.asgi import ASGIApp, Headers, Message, Receive, Scope, Send, read_body
from server.gateway.request.endpoints import BY_PATH
from server.gateway.request.request import GatewayRequest, parse_request

Step = Callable[[GatewayRequest], Awaitable[None]]


class StepRouter:
    def __init__(self, step: Step, app: ASGIApp) -> None:
        self.step = step
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = BY_PATH.get(scope.get("path", ""))
        if scope["type"] != "http" or scope["method"] != "POST" or endpoint is None:
            await self.app(scope, receive, send)
            return
        request = None
        try:
            raw = await read_body(receive, scope["headers"], 32 * 2**20)
            request = parse_request(raw, endpoint, headers=list(scope["headers"]))
            await self.step(request)
        except GatewayError as exc:
            await send_error(send, exc, request.response_headers if request is not None else [])
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"transfer-encoding")]
        scope = dict(scope, headers=[*headers, (b"content-length", str(len(request.raw)).encode())])
        await self.app(scope, _once(request.raw, receive), _adding(send, request.response_headers))


def _once(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _adding(send: Send, headers: Headers) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *headers])
        await send(message)

    return wrapped
