"""Helpers shared by the tests: ports, polling for a condition, waiting for HTTP, real uvicorn servers in a thread.

Tests never sleep and then assert: what another thread or process does (a counter, a log line
written after the response, a health state) is polled for with `wait_for` under a generous
deadline, so that a busy machine makes a test slower, never red.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import httpx
import uvicorn

T = TypeVar("T")

WAIT_TIMEOUT = 30.0  # seconds; a condition that holds on a quiet machine in milliseconds


def free_port() -> int:
    """A loopback port free right now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses every connection while the block runs.

    The port stays bound (never listening), so no other process can start serving on it meanwhile:
    a `free_port()` used as "nothing listens here" may be taken by another test run's server.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def refuses_connections(url: str, path: str = "/health", *, unanswered: bool = True) -> bool:
    """Whether the server at `url` refuses new connections (its listening socket is closed).

    A connection closed without an answer (it got into a closing listener's backlog, or was
    accepted as the server shut down) was never served: refused when `unanswered` is True; with
    False it is neither refused nor served yet, and the caller polls again.
    """
    try:
        httpx.get(f"{url}{path}", timeout=2, headers={"connection": "close"})
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return unanswered
    return False


def wait_for(
    predicate: Callable[[], T],
    timeout: float = WAIT_TIMEOUT,
    interval: float = 0.02,
    what: str | Callable[[], object] = "",
) -> T:
    """Poll `predicate` until it returns something truthy, and return that; fail after `timeout` s.

    `what` describes the condition in the failure message (a callable is called then, e.g. to show
    the state that was last seen).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"condition not reached within {timeout:g} s" + (f": {detail}" if detail else ""))
        time.sleep(interval)


async def async_wait_for(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = WAIT_TIMEOUT,
    interval: float = 0.02,
    what: str | Callable[[], object] = "",
) -> T:
    """`wait_for` inside an event loop: sleeps without blocking it; `predicate` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"condition not reached within {timeout:g} s" + (f": {detail}" if detail else ""))
        await asyncio.sleep(interval)


def wait_http(url: str, timeout: float = WAIT_TIMEOUT, status: int = 200) -> None:
    """Poll `url` until it answers `status`, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == status:
                return
            last = response.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {status} within {timeout} s (last: {last!r})")


@contextlib.contextmanager
def raw_post(url: str, body: object) -> Iterator[socket.socket]:
    """POST `body` as JSON to `url` over a plain socket; leaving the block closes the connection.

    For a client that leaves at a moment the test chooses (once the engine has the request, say),
    where a client read timeout would leave at a moment the machine's load chooses.
    """
    parts = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {parts.raw_path.decode()} HTTP/1.1\r\nhost: {parts.host}:{parts.port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.host, parts.port), timeout=WAIT_TIMEOUT) as sock:
        sock.sendall(head + payload)
        yield sock


@contextlib.contextmanager
def serve_in_thread(app, port: int | None = None, **config) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server on loopback; yields its base URL.

    Without `port`, the listening socket is bound here and handed to uvicorn, so no other process
    can take the port between choosing it and serving on it.
    """
    sockets: list[socket.socket] | None = None
    if port is None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sockets = [sock]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            for sock in sockets or ():
                sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        for sock in sockets or ():
            sock.close()  # uvicorn closed it already, unless it never started
