"""What an engine (or anything on its port) can make the gateway hold: bounded, whatever it sends.

A hostile engine on loopback answers a non-streamed chat request with a 1 GB body (chunked, then
announced by content-length) or with a 2 MB header. The gateway reads at most
`limits.max_answer_bytes` of an answer it buffers and at most 64 KiB of an answer's head (http1),
answers 502 in the envelope, and keeps serving. Its memory is sampled while it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import chat_body, fast_settings

MiB = 2**20
GiB = 2**30
CARDS = b'{"object":"list","data":[{"id":"hostile","object":"model","max_model_len":4096}]}'
ANSWER = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'


def _whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


class HostileEngine:
    """An engine that answers health checks and model reads, and chat requests as `mode` says:
    "chunked" (a 1 GiB chunked body), "announced" (content-length 1 GiB, sent slowly), "header"
    (a 2 MiB header value), "ok" (a normal answer). `sent` counts the body bytes it wrote."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.sent = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # the `_answer`s that have started

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        self._writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0]
                length = next(
                    (int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")),
                    0,
                )
                if length:
                    await reader.readexactly(length)
                if b"/v1/chat/completions" not in line:
                    body = CARDS if b"/v1/models" in line else b"{}"
                    writer.write(_whole(body))
                    await writer.drain()
                    continue
                await getattr(self, f"_{self.mode}")(writer)
                if self.mode != "ok":
                    break
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        self._writers.discard(writer)
        self._handlers.discard(handler)

    async def _shut(self) -> None:
        """Close the listener and every connection, and let the loop finish closing them: a
        transport left closing when the loop stops is a ResourceWarning in whatever test runs when
        the garbage collector finds it (CI of stop 40 failed two later tests on that).

        A connection the loop has just accepted (a gateway's last health check, say) is first an
        asyncio task of its own that holds the bare socket until it makes the transport, then a
        handler that has not started. Cancelled then, or made on a closed server (an assertion
        Python 3.11 swallows), that socket is never closed: so the listener closes only once every
        connection has reached a started handler, and handlers end by their connection's abort,
        never by a cancel before they start."""
        assert self._server is not None
        this = asyncio.current_task()
        for _ in range(10_000):  # an accept on its way to its handler: a few turns of the loop
            if all(task is this or task in self._handlers for task in asyncio.all_tasks()):
                break
            await asyncio.sleep(0)
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # close() would wait on a buffer the peer may never read
        handlers = [task for task in self._handlers if not task.done()]
        if handlers:
            _, stuck = await asyncio.wait(handlers, timeout=30)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        await self._server.wait_closed()

    async def _ok(self, writer: asyncio.StreamWriter) -> None:
        writer.write(_whole(ANSWER))
        await writer.drain()

    async def _chunked(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"x" * MiB
        frame = b"%x\r\n%b\r\n" % (len(piece), piece)
        while self.sent < GiB:
            writer.write(frame)
            self.sent += len(piece)
            await writer.drain()  # raises once the gateway has closed the connection
        writer.write(b"0\r\n\r\n")

    async def _announced(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % GiB)
        while self.sent < GiB:
            writer.write(b"x" * 65536)
            self.sent += 65536
            await writer.drain()
            await asyncio.sleep(0.01)

    async def _header(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-huge: " + b"h" * (2 * MiB) + b"\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    @contextlib.contextmanager
    def running(self) -> Iterator[HostileEngine]:
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._answer, "127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
            started.set()
            self._loop.run_forever()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert started.wait(30)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(timeout=60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(60)
            self._loop.close()


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """[peak] of this process's RSS, sampled every 5 ms while the block runs."""
    peak = [rss()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join(5)


@pytest.fixture
def hostile() -> Iterator[HostileEngine]:
    with HostileEngine().running() as engine:
        yield engine


@pytest.mark.one_process("samples the gateway's own memory, which runs in this process")
def test_a_1_gb_buffered_answer_is_cut_at_the_cap_and_memory_stays_bounded(hostile, gateway):
    gw = gateway(fast_settings({"hostile": [hostile.url]}))
    url = f"{gw.url}/v1/chat/completions"
    assert httpx.post(url, json=chat_body(model="hostile"), timeout=60).status_code == 200  # warmed up
    hostile.mode = "chunked"
    before = rss()
    with peak_rss() as peak:
        response = httpx.post(url, json=chat_body(model="hostile"), timeout=120)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "engine_answer_too_large" and str(64 * MiB) in error["message"]
    assert hostile.sent < 256 * MiB  # it stopped reading near the cap, not at 1 GiB
    # The bound: the pieces read, then their joined copy, about twice the 64 MiB cap.
    growth = peak[0] - before
    assert growth < 2 * 64 * MiB + 48 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB"
    hostile.mode = "ok"
    assert httpx.post(url, json=chat_body(model="hostile"), timeout=60).status_code == 200  # still serving


def test_an_answer_announced_larger_than_the_cap_is_refused_before_it_is_read(hostile, gateway):
    gw = gateway(fast_settings({"hostile": [hostile.url]}, limits={"max_answer_bytes": 1 * MiB}))
    hostile.mode = "announced"
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="hostile"), timeout=60)
    assert response.status_code == 502 and response.json()["error"]["code"] == "engine_answer_too_large"
    assert "1048576 bytes" in response.json()["error"]["message"]
    assert hostile.sent < 64 * MiB


def test_an_engine_header_over_the_cap_is_a_502_and_never_reaches_the_client(hostile, gateway):
    gw = gateway(fast_settings({"hostile": [hostile.url]}, retries={"max_attempts": 1}))
    hostile.mode = "header"
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="hostile"), timeout=60)
    assert response.status_code == 502, response.text[:500]
    assert "x-huge" not in response.headers
    assert response.json()["error"]["type"] == "upstream_error"
    hostile.mode = "ok"
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="hostile"), timeout=60).status_code == 200
