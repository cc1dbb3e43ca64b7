"""How the proxy talks to engines: the `Upstream` interface, and an httpx client seen through it.

The proxy posts through `Upstream.post` and reads an `UpstreamResponse` whole, or chunk by
chunk into a synchronous sink (`splice`: the gateway's transport calls it from its protocol
callback, with no task step per chunk). The gateway's own `proxy.transport.UpstreamTransport`
implements it on `http1` (the HTTP/1.1 client package the load tester and the benches share)
without httpx objects on the hot path; `ClientUpstream` adapts any `httpx.AsyncClient` (one a
caller injects, in tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx


class UpstreamResponse(Protocol):
    """An engine's answer as the proxy reads it: body chunks as they arrive, or whole."""

    status_code: int
    headers: list[tuple[bytes, bytes]]

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def read_chunk(self) -> bytes: ...  # what arrived since the last call; b"" at the end

    async def splice(
        self, sink: Callable[[bytes], None], flush: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """The rest of the body to `sink`, chunk by chunk, and `flush()` after what arrived together; when
        that returns True, `drain()` before reading on."""
        ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """How the proxy talks to engines: UpstreamTransport, or ClientUpstream around any httpx client."""

    def target(self, url: str, method: str = "POST") -> Any: ...

    async def post(
        self,
        target: Any,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        sent: Callable[[], object] | None = None,
    ) -> UpstreamResponse:
        """Send a request; its answer once the head arrived. `sent()`: once the request is written
        (the gateway's own transport), or once the head arrived (httpx tells nothing sooner)."""
        ...


class _ClientResponse:
    """An httpx.Response as an `UpstreamResponse`."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.headers = response.headers.raw
        self._chunks: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.response.aiter_raw()

    async def read_chunk(self) -> bytes:
        if self._chunks is None:
            self._chunks = self.response.aiter_raw()
        return await anext(self._chunks, b"")

    async def splice(
        self, sink: Callable[[bytes], None], flush: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        if self._chunks is None:
            self._chunks = self.response.aiter_raw()
        async for chunk in self._chunks:
            sink(chunk)
            if flush():
                await drain()

    async def aread(self) -> bytes:
        return await self.response.aread()

    async def aclose(self) -> None:
        await self.response.aclose()


class ClientUpstream:
    """Any httpx.AsyncClient (one a caller injects, in tests) with the `post` of UpstreamTransport."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    def target(self, url: str, method: str = "POST") -> tuple[str, httpx.URL]:
        return method, httpx.URL(url)

    async def post(
        self,
        target: tuple[str, httpx.URL],
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        sent: Callable[[], object] | None = None,
    ) -> _ClientResponse:
        timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=connect_timeout, pool=connect_timeout)
        method, url = target
        request = self.client.build_request(method, url, content=body, headers=headers, timeout=timeout)
        response = await self.client.send(request, stream=True)
        if sent is not None:  # (httpx says nothing between writing the request and reading the head)
            sent()
        return _ClientResponse(response)
