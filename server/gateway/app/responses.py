"""The Responses API's stored state, answered by the gateway itself from its response store.

    POST   /v1/responses                      create: the engine answers a stateless request
    GET    /v1/responses/{id}                 the stored response object
    DELETE /v1/responses/{id}                 {"id", "object": "response.deleted", "deleted": true}
    GET    /v1/responses/{id}/input_items     the request's input items (OpenAI's list shape)
    POST   /v1/responses/{id}/cancel          400: only background responses can be, and there are none

A create with `store` (the default) or a `previous_response_id` is stateful: the chain is read
from the store (conversations.store), its whole input built (records.chain_input) and sent with
`store: false` and no `previous_response_id`, through the same steps as any proxied request
(auth, tenants' quotas, history trimming, cache-aware routing to any replica: app.proxied), with
the conversation's first response id as its routing session (`routing.session_header`, unless the
client sent one), so its turns keep finding their prefix in one replica's cache while it serves;
the answer is read on its way to the client (conversations.answer) and recorded once it ends:
`completed`/`incomplete`/`failed` as the engine said, `incomplete` when the stream was cut short
(a client that left, an engine that died), nothing when the engine refused the request.

Everything is scoped by the caller's tenant (the key's; "" without tenants): another tenant's id
is answered 404 exactly as an id that never existed. A store that fails mid-run answers stateful
requests 503 (`response_store_unavailable`); stateless ones (`store: false`, no previous id) never
touch it and are still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any
from urllib.parse import parse_qsl

from server.gateway.app.auth import check_api_key, identify_tenant
from server.gateway.app.proxied import ProxiedEndpoints
from server.gateway.conversations.answer import AnswerTap
from server.gateway.conversations.errors import StoreUnavailable
from server.gateway.conversations.records import (
    StoredResponse,
    chain_input,
    client_response,
    deleted,
    input_items,
    listed_input_items,
    new_response_id,
)
from server.gateway.conversations.store import ResponseStore, retention_seconds
from server.gateway.errors import (
    ClientDisconnected,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ResponseNotFound,
    echo,
    send_error,
)
from server.gateway.http.asgi import Message, Receive, Scope, Send, read_body, send_bytes
from server.gateway.http.seam import mark_authenticated
from server.gateway.jsonio import dumps, loads
from server.gateway.observability.record import RequestRecord
from server.gateway.request.checks import wrong_type
from server.gateway.request.endpoints import BY_NAME
from server.gateway.request.ids import request_id_from
from server.gateway.request.targets import served
from server.gateway.settings import ResponsesStore

log = logging.getLogger("gateway.responses")

PREFIX = "/v1/responses"
CREATE = BY_NAME["responses"]
Handler = Callable[[Scope, Receive, Send, str], Awaitable[None]]


def replay(raw: bytes, receive: Receive) -> Receive:
    """`receive` that gives `raw` as the whole body first, then what the client's connection says."""
    sent = False

    async def receiving() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return receiving


class ResponsesApi:
    """The Responses routes (see the module doc); one per app. `store` None: `backend: off`."""

    def __init__(self, *, proxied: ProxiedEndpoints, store: ResponseStore | None, config: ResponsesStore) -> None:
        self.proxied = proxied
        self.store = store
        self.config = config
        self._purger: asyncio.Task[None] | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store (StoreUnavailable refuses the start, with the reason) and start the purge."""
        if self.store is None:
            return
        await self.store.open()
        log.info("response store: %s", self.store.description)
        self._purger = asyncio.create_task(self._purge_forever(), name="response-store-purge")

    async def aclose(self) -> None:
        if self._purger is not None:
            self._purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._purger
        if self.store is not None:
            await self.store.close()

    async def _purge_forever(self) -> None:
        assert self.store is not None
        while True:
            try:
                purged = await self.store.purge(time.time())
                if purged:
                    log.info("response store: purged %d responses past their retention", purged)
            except StoreUnavailable as exc:
                log.warning("response store: purge failed: %s", exc.message)
            await asyncio.sleep(self.config.purge_interval)

    # -- routing ----------------------------------------------------------------------------------

    def route(self, path: str, method: str) -> tuple[Handler, str] | None:
        """The handler of `method path` and its response id; None for paths not ours."""
        if path == PREFIX:
            return (self.create, "") if method == "POST" else None
        if not path.startswith(PREFIX + "/"):
            return None
        rest = path[len(PREFIX) + 1 :]
        response_id, _, tail = rest.partition("/")
        if not response_id:
            return None
        table: dict[tuple[str, str], Handler] = {
            ("", "GET"): self.retrieve,
            ("", "DELETE"): self.delete,
            ("input_items", "GET"): self.input_items,
            ("cancel", "POST"): self.cancel,
        }
        handler = table.get((tail, method))
        return (handler, response_id) if handler is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.route(scope["path"], scope["method"])
        if found is None:  # a Route of ours matched the path, with a method we do not serve
            await send_error(send, MethodNotAllowed("Method not allowed on this endpoint."))
            return
        handler, response_id = found
        await handler(scope, receive, send, response_id)

    def _caller(self, headers: list[tuple[bytes, bytes]]) -> str:
        """The caller's tenant name ("" without tenants); AuthenticationFailed for a bad key."""
        proxied = self.proxied
        if proxied.tenants is not None:
            return identify_tenant(headers, proxied.tenants).name
        check_api_key(headers, proxied.keys)
        return ""

    def _store(self) -> ResponseStore:
        if self.store is None:
            raise InvalidRequest(
                "Stored responses are off on this gateway (responses_store.backend: off); "
                "send `store: false` without `previous_response_id`.",
                code="response_store_off",
            )
        return self.store

    # -- create -----------------------------------------------------------------------------------

    async def create(self, scope: Scope, receive: Receive, send: Send, _: str) -> None:
        headers = scope["headers"]
        rid = request_id_from(headers)
        try:
            tenant = self._caller(headers)
        except GatewayError:
            await self.proxied.handle(CREATE, scope, receive, send)  # refused there, counted and logged
            return
        try:
            raw = await read_body(receive, headers, self.proxied.max_body_bytes)
        except ClientDisconnected:
            return
        except GatewayError as exc:
            await send_error(send, exc, [(b"x-request-id", rid.encode())])
            return
        try:
            body = loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        if not isinstance(body, dict):  # the proxied handler refuses it, in the envelope
            await self.proxied.handle(CREATE, scope, replay(raw, receive), send)
            return
        try:
            plan = await self._plan(tenant, body)
        except GatewayError as exc:
            await self._refuse(send, exc, rid, body.get("model"), tenant)
            return
        if plan is None:  # stateless: the engine's answer as it is, the store untouched
            await self.proxied.handle(CREATE, scope, replay(raw, receive), send)
            return
        engine_body, response_id, root = plan
        mark_authenticated(send, keys_checked=bool(self.proxied.keys))
        previous = body.get("previous_response_id")
        store = body.get("store", True) is not False

        def patch(answer: dict[str, Any]) -> dict[str, Any]:
            return client_response(answer, response_id=response_id, previous=previous, body=body, store=store)

        tap = AnswerTap(send, patch, stream=body.get("stream") is True)
        sent = dumps(engine_body)
        scope = dict(scope, headers=[(k, v) for k, v in headers if k.lower() != b"content-length"])
        scope["headers"].append((b"content-length", str(len(sent)).encode()))
        session = self.proxied.proxy.context.settings.routing.session_header.lower().encode()
        if not any(k.lower() == session for k, _ in headers):  # one conversation, one routing session (its first id)
            scope["headers"].append((session, root.encode()))
        try:
            await self.proxied.handle(CREATE, scope, replay(sent, receive), tap)
        finally:
            if store and tap.status == 200:
                record = self._record(tenant, body, response_id, tap)
                await asyncio.shield(self._save(record, rid))

    async def _plan(self, tenant: str, body: dict[str, Any]) -> tuple[dict[str, Any], str, str] | None:
        """The engine's body, the new response's id and its conversation's first id; None for a
        stateless request."""
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise wrong_type("store", "a boolean", store)
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise wrong_type("previous_response_id", "a string", previous)
        if body.get("background") is True:
            raise InvalidRequest(
                "Background responses are not served by this gateway; stream the answer instead.",
                param="background",
                code="unsupported_value",
            )
        if previous is None and (not store or self.store is None):
            return None
        if previous is None:
            await self._store().check()  # a store that is down: 503 now, not an answer that is lost
            chain = []
        else:
            chain = await self._store().chain(tenant, previous, time.time())
            if not chain:
                raise not_found(previous, "previous_response_id")
        response_id = new_response_id()
        engine_body = {key: value for key, value in body.items() if key != "previous_response_id"}
        if chain:
            engine_body["input"] = chain_input(chain, body.get("input"))
        engine_body["store"] = False
        engine_body["request_id"] = response_id  # vLLM names the response after it
        return engine_body, response_id, chain[0].id if chain else response_id

    async def _refuse(self, send: Send, exc: GatewayError, rid: str, model: Any, tenant: str) -> None:
        """A create refused before any engine: answered in the envelope, counted and logged like the
        proxied handler's refusals (under the model it named, if that one is served)."""
        record = RequestRecord(rid, CREATE.name, perf_counter(), tenant=tenant or None)
        if isinstance(model, str) and served(self.proxied.state.upstreams, model):
            self.proxied.reporter.open(record, model)
        record.status, record.error = exc.status, exc.message
        await send_error(send, exc, [(b"x-request-id", rid.encode())])
        self.proxied.reporter.finish(record)

    def _record(self, tenant: str, body: dict[str, Any], response_id: str, tap: AnswerTap) -> StoredResponse:
        now = time.time()
        final = tap.final
        if final is not None:
            output = final.get("output") if isinstance(final.get("output"), list) else []
            status = str(final.get("status") or "completed")
            response = final
        else:  # cut short: the items that were whole, and `incomplete`
            output, status = list(tap.done_items), "incomplete"
            response = {
                "id": response_id,
                "object": "response",
                "created_at": int(now),
                "status": status,
                "incomplete_details": {"reason": "interrupted"},
                "model": body.get("model"),
                "output": output,
                "previous_response_id": body.get("previous_response_id"),
                "instructions": body.get("instructions"),
                "tools": body.get("tools") or [],
                "store": True,
                "usage": None,
            }
        usage = response.get("usage") if isinstance(response.get("usage"), dict) else None
        tools = body.get("tools")
        return StoredResponse(
            id=response_id,
            tenant=tenant,
            model=str(body.get("model", "")),
            status=status,
            input_items=input_items(body.get("input")),
            output_items=list(output or []),
            response=response,
            previous_response_id=body.get("previous_response_id"),
            instructions=body.get("instructions"),
            tools=tools if isinstance(tools, list) else None,
            usage=usage,
            created_at=now,
            expires_at=now + retention_seconds(self.config, tenant),
        )

    async def _save(self, record: StoredResponse, rid: str) -> None:
        assert self.store is not None
        try:
            await self.store.save(record)
        except StoreUnavailable as exc:
            log.error("request %s: response %s was answered but not stored: %s", rid, record.id, exc.message)

    # -- stored state -----------------------------------------------------------------------------

    async def _stored(self, scope: Scope, send: Send, response_id: str) -> tuple[StoredResponse, str] | None:
        """The stored response the path names, for the caller; None once an error was sent."""
        rid = request_id_from(scope["headers"])
        try:
            tenant = self._caller(scope["headers"])
            stored = await self._store().get(tenant, response_id, time.time())
            if stored is None:
                raise not_found(response_id, "response_id")
            return stored, tenant
        except GatewayError as exc:
            await send_error(send, exc, [(b"x-request-id", rid.encode())])
            return None

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, response_id: str) -> None:
        found = await self._stored(scope, send, response_id)
        if found is not None:
            await _json(send, scope, found[0].response)

    async def input_items(self, scope: Scope, receive: Receive, send: Send, response_id: str) -> None:
        rid = request_id_from(scope["headers"])
        try:
            options = _list_options(scope.get("query_string", b""))
        except GatewayError as exc:
            await send_error(send, exc, [(b"x-request-id", rid.encode())])
            return
        found = await self._stored(scope, send, response_id)
        if found is not None:
            await _json(send, scope, listed_input_items(found[0], **options))

    async def delete(self, scope: Scope, receive: Receive, send: Send, response_id: str) -> None:
        found = await self._stored(scope, send, response_id)
        if found is None:
            return
        stored, tenant = found
        try:
            assert self.store is not None
            if not await self.store.delete(tenant, stored.id):
                raise not_found(response_id, "response_id")
        except GatewayError as exc:
            await send_error(send, exc, [(b"x-request-id", request_id_from(scope["headers"]).encode())])
            return
        await _json(send, scope, deleted(stored.id))

    async def cancel(self, scope: Scope, receive: Receive, send: Send, response_id: str) -> None:
        found = await self._stored(scope, send, response_id)
        if found is not None:
            refusal = InvalidRequest(
                f"Response '{echo(response_id)}' cannot be cancelled: only background responses can be, "
                "and this gateway serves none.",
                param="response_id",
                code="not_cancellable",
            )
            await send_error(send, refusal, [(b"x-request-id", request_id_from(scope["headers"]).encode())])


def not_found(response_id: str, param: str) -> ResponseNotFound:
    return ResponseNotFound(f"Response with id '{echo(response_id)}' not found.", param=param)


def _list_options(query: bytes) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query.decode("latin-1")):
        if key == "order":
            if value not in ("asc", "desc"):
                raise InvalidRequest("`order` must be `asc` or `desc`.", param="order", code="invalid_value")
            options["order"] = value
        elif key == "after":
            options["after"] = value
        elif key == "limit":
            if not value.isdigit() or not 1 <= int(value) <= 100:
                raise InvalidRequest("`limit` must be a number from 1 to 100.", param="limit", code="invalid_value")
            options["limit"] = int(value)
    return options


async def _json(send: Send, scope: Scope, value: Any) -> None:
    rid = request_id_from(scope["headers"]).encode()
    await send_bytes(send, 200, dumps(value), b"application/json", [(b"x-request-id", rid)])
