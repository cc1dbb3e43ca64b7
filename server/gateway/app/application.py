"""The gateway as a FastAPI application: its own routes, the proxied OpenAI endpoints, errors, docs.

    GatewayApp(FastAPI)
      ├─ app.ops routes          /v1/models[/{model}], /health, /ready, /metrics   (FastAPI routes)
      ├─ proxied endpoints       request.endpoints.ENDPOINTS -> app.proxied         (raw ASGI routes)
      ├─ /openapi.json, /docs    both kinds described (app.openapi); Swagger UI served from here
      └─ users' routes, dependencies and middleware, the FastAPI way (app.hooks: `--app-hook`)

A proxied request goes straight to its handler when no user middleware is installed: the
relay then writes a stream's chunks to the client's connection itself (http.seam) and FastAPI's
routing and error middleware cost it nothing. With user middleware, every request, proxied ones
included, passes through it as through any FastAPI app (the middleware sees each message, so a
stream goes through ASGI `send`, a little slower). Every refusal, 404 and 405 included, is in the
OpenAI error envelope and carries `x-request-id`; nothing redirects; an unknown path needs the
API key before it is answered 404 (it says nothing about what is served to a caller without one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException
from starlette.routing import Route

from server.gateway.app import ops
from server.gateway.app.auth import check_api_key
from server.gateway.app.openapi import proxied_paths, stored_response_paths
from server.gateway.app.proxied import ProxiedEndpoints
from server.gateway.app.responses import ResponsesApi
from server.gateway.app.state import GatewayState
from server.gateway.errors import (
    GatewayError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    error_body,
)
from server.gateway.http.asgi import Message, Receive, Scope, Send
from server.gateway.request.endpoints import BY_PATH, ENDPOINTS, Endpoint, match
from server.gateway.request.ids import REQUEST_ID_HEADER, request_id_from

log = logging.getLogger("gateway")

DOCS_ASSETS = "/docs/assets"
_ASSET_TYPES = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}


class _ProxiedRoute:
    """The ASGI app of one proxied endpoint as a Starlette route (the path under user middleware)."""

    __slots__ = ("endpoint", "handler")

    def __init__(self, handler: ProxiedEndpoints, endpoint: Endpoint) -> None:
        self.handler = handler
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        param = scope.get("path_params", {}).get("response_id", "")
        await self.handler.handle(self.endpoint, scope, receive, send, param)


class GatewayApp(FastAPI):
    """The OpenAI-compatible gateway (see the module doc); `create_app` assembles one."""

    state: GatewayState

    def __init__(
        self,
        *,
        state: GatewayState,
        proxied: ProxiedEndpoints,
        responses: ResponsesApi | None = None,
        lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
        title: str = "llm-serving gateway",
        version: str = "0.1.0",
    ) -> None:
        super().__init__(
            title=title,
            version=version,
            summary="An OpenAI-compatible gateway in front of vLLM engines.",
            lifespan=lifespan,
            docs_url=None,  # served below, from local assets: no CDN in an air-gapped cluster
            redoc_url=None,
            openapi_url="/openapi.json",
            redirect_slashes=False,  # nothing redirects: a redirect would echo the client's Host
        )
        self.state = state
        self.proxied = proxied
        self.responses = responses  # the Responses API's stored state (app.responses), ahead of the proxied routes
        self.include_router(ops.router)
        if responses is not None:
            for path in ("/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/{tail}"):
                self.router.routes.append(Route(path, responses, include_in_schema=False))
        for endpoint in ENDPOINTS:
            self.router.routes.append(
                Route(
                    endpoint.path,
                    _ProxiedRoute(proxied, endpoint),
                    methods=[endpoint.method],
                    name=endpoint.name,
                    include_in_schema=False,
                )
            )
        self.add_api_route("/docs", self._docs, include_in_schema=False, methods=["GET"])
        self.add_api_route(DOCS_ASSETS + "/{name}", self._docs_asset, include_in_schema=False, methods=["GET"])
        self.add_exception_handler(GatewayError, self._gateway_error)  # type: ignore[arg-type]
        self.add_exception_handler(HTTPException, self._http_error)  # type: ignore[arg-type]
        self.add_exception_handler(RequestValidationError, self._validation_error)  # type: ignore[arg-type]
        self.add_exception_handler(Exception, self._unexpected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if self.responses is not None and self.responses.route(path, method) is not None:
                if not self.user_middleware:
                    await self.responses(scope, receive, send)
                    return
                await super().__call__(scope, receive, send)
                return
            endpoint = BY_PATH.get(path) if method == "POST" else None
            param = ""
            if endpoint is None and (found := match(path, method)) is not None:
                endpoint, param = found
            if endpoint is None:
                send = _with_request_id(scope, send)  # the gateway's own routes and refusals
            elif not self.user_middleware:
                await self.proxied.handle(endpoint, scope, receive, send, param)
                return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's description of its own routes, with the proxied endpoints added (app.openapi)."""
        if self.openapi_schema is None:
            schema: dict[str, Any] = super().openapi()
            paths, components = schema.setdefault("paths", {}), schema.setdefault("components", {})
            paths.update(proxied_paths(ENDPOINTS, components))
            if self.responses is not None:  # (merged: retrieve's GET is the endpoint table's)
                for path, item in stored_response_paths(components).items():
                    paths.setdefault(path, {}).update(item)
            self.openapi_schema = schema
        return schema if (schema := self.openapi_schema) is not None else {}

    # -- docs -------------------------------------------------------------------------------------

    async def _docs(self) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=self.openapi_url or "/openapi.json",
            title=f"{self.title} - API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url="data:,",
        )

    async def _docs_asset(self, name: str) -> Response:
        media_type = _ASSET_TYPES.get(name)
        if media_type is None:
            raise RouteNotFound(f"No such endpoint: GET {DOCS_ASSETS}/{name[:100]}")
        data = (resources.files("fastapi_offline") / "static" / name).read_bytes()
        return Response(data, media_type=media_type, headers={"cache-control": "public, max-age=86400"})

    # -- errors: the OpenAI envelope everywhere ---------------------------------------------------

    @staticmethod
    def _envelope(exc: GatewayError) -> Response:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in exc.headers}
        return Response(error_body(exc), status_code=exc.status, media_type="application/json", headers=headers)

    async def _gateway_error(self, request: Request, exc: GatewayError) -> Response:
        return self._envelope(exc)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own refusals (no route: 404; a known path with another method: 405)."""
        method, path = request.method, request.url.path
        try:
            if method != "OPTIONS" and (self.state.protect_ops or path not in ops.OPEN_PATHS):
                check_api_key(request.scope["headers"], self.state.keys)
        except GatewayError as refused:
            return self._envelope(refused)
        if exc.status_code == 405:
            return self._envelope(MethodNotAllowed("Method not allowed on this endpoint."))
        if exc.status_code == 404:
            return self._envelope(RouteNotFound(f"No such endpoint: {method} {path[:200]}"))
        error = GatewayError(str(exc.detail))
        error.status = exc.status_code
        return self._envelope(error)

    async def _validation_error(self, request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return self._envelope(InvalidRequest(f"Invalid request: {problems}"[:2000]))

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        rid = request_id_from(request.scope["headers"])
        log.error("unexpected error in %s %s (request %s)", request.method, request.url.path[:200], rid, exc_info=exc)
        return self._envelope(InternalError(f"The gateway failed unexpectedly; its log has the details under {rid}."))


def _with_request_id(scope: Scope, send: Send) -> Send:
    """`send` that adds `x-request-id` to a response head that lacks one (the gateway's own routes)."""
    rid = request_id_from(scope["headers"]).encode()

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(name.lower() == REQUEST_ID_HEADER for name, _ in headers):
                headers.append((REQUEST_ID_HEADER, rid))
                message = {**message, "headers": headers}
        await send(message)

    return sending
