"""The seam writes the gateway's answer heads itself (http.writers: `start_body`, `send_whole`), as
uvicorn's `send` would: byte for byte the same head and the same connection state after it, for
streamed and whole answers, keep-alive or not; and the heads it does not handle (a `connection`
header, HEAD, 204, a value uvicorn refuses) still go through uvicorn's `send`, with its outcome.
Real uvicorn servers with the gateway's protocol, raw sockets (the bytes are the claim)."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from server.gateway.http import writers
from server.gateway.http.seam import ConnectionLimits, send_whole, start_body
from server.gateway.http.writers import ChunkedWriter
from tests.support import serve_in_thread

RATE_LIMITS = [
    (b"x-ratelimit-limit-requests", b"600"),
    (b"x-ratelimit-remaining-requests", b"599"),
    (b"x-ratelimit-reset-requests", b"100ms"),
    (b"x-ratelimit-limit-tokens", b"200000"),
    (b"x-ratelimit-remaining-tokens", b"199000"),
    (b"x-ratelimit-reset-tokens", b"300ms"),
]
HEADERS = {
    "none": [],
    "sse": [(b"content-type", b"text/event-stream"), (b"X-Request-Id", b"abc-1")],  # mixed case: lowered
    "tenant": [(b"content-type", b"application/json"), *RATE_LIMITS, (b"x-request-id", b"r2")],
    "connection": [(b"content-type", b"text/plain"), (b"connection", b"close")],  # uvicorn's send writes it
    "bad-value": [(b"x-bad", b"a\x01b")],  # uvicorn's send refuses it: the app fails, the connection closes
    "bad-name": [(b"x bad", b"v")],
    "newline-name": [(b"x-a\nx-b", b"v")],
}
BODY = b'{"ok": true}'


class Heads:
    """/{uvicorn,seam}/{stream,whole}/{HEADERS key}: the same answer through uvicorn's `send` or the
    seam's writers; the cycle's state after the head is kept by path."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, Any]] = {}
        self.written_here: dict[str, bool] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        _, who, shape, name = scope["path"].split("/")
        status = 204 if name == "no-content" else 200
        headers = list(HEADERS.get(name, []))
        cycle = send.__self__
        if shape == "whole":
            headers.append((b"content-length", b"0" if status == 204 else str(len(BODY)).encode()))
            start = {"type": "http.response.start", "status": status, "headers": headers}
            body = b"" if status == 204 else BODY
            if who == "seam":
                await send_whole(send, start, body)
            else:
                await send(start)
                await send({"type": "http.response.body", "body": body, "more_body": False})
            self.keep(scope["path"], cycle)
            return
        start = {"type": "http.response.start", "status": status, "headers": headers}
        if who == "seam":
            writer = await start_body(send, start)
            self.keep(scope["path"], cycle, writer=type(writer).__name__)
            writer.write(b"data: one\n\n")
            writer.write(b"data: two\n\n")
            writer.flush()
            await send({"type": "http.response.body", "body": writer.release(), "more_body": False})
        else:
            await send(start)
            self.keep(scope["path"], cycle)
            await send({"type": "http.response.body", "body": b"data: one\n\ndata: two\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def keep(self, path: str, cycle: Any, **extra: str) -> None:
        fields = ("response_started", "chunked_encoding", "expected_content_length", "waiting_for_100_continue")
        self.state[path] = {field: getattr(cycle, field) for field in fields} | extra


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[int, Heads]]:
    """The app on a real uvicorn server, with http.writers' head writer watched: `app.written_here`
    says by path whether it wrote the head (True) or left it to uvicorn's send (False)."""
    app = Heads()
    real = writers._head

    def watched(cycle: Any, status: int, headers: Any) -> bytes | None:
        head = real(cycle, status, headers)
        app.written_here[cycle.scope["path"]] = head is not None
        return head

    protocol = ConnectionLimits(header_timeout=30, body_timeout=30, max_connections=100).protocol()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writers, "_head", watched)
        with serve_in_thread(app, http=protocol, access_log=False) as url:  # as the gateway serves (serving.process)
            yield int(url.rsplit(":", 1)[1]), app


def exchange(port: int, path: str, *, method: str = "GET", close: bool = False, expect: bool = False) -> bytes:
    """The raw bytes of one answer (the connection closed by the client after a short read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"{method} {path} HTTP/1.1\r\nhost: x\r\n" + ("connection: close\r\n" if close else "")
        if expect:  # a body announced and held back until the server asks (it never does: the answer comes first)
            head += "content-length: 2\r\nexpect: 100-continue\r\n"
        head += "\r\n"
        sock.sendall(head.encode())
        data = b""
        while not (data.endswith(b"0\r\n\r\n") or data.endswith(BODY) or b"\r\n\r\n" in data and method == "HEAD"):
            more = sock.recv(65536)
            if not more:
                break
            data += more
            if b" 204 " in data.split(b"\r\n", 1)[0] and b"\r\n\r\n" in data:
                break
    return data


def without_date(raw: bytes) -> bytes:
    return b"\r\n".join(line for line in raw.split(b"\r\n") if not line.lower().startswith(b"date:"))


@pytest.mark.parametrize("shape", ["stream", "whole"])
@pytest.mark.parametrize("name", ["none", "sse", "tenant"])
@pytest.mark.parametrize(
    ("close", "expect"), [(False, False), (True, False), (False, True)], ids=["keep-alive", "close", "expect-100"]
)
def test_the_seams_head_is_uvicorns_byte_for_byte_and_leaves_the_cycle_as_uvicorns_send_does(
    served, shape, name, close, expect
):
    port, app = served
    ours = exchange(port, f"/seam/{shape}/{name}", close=close, expect=expect)
    theirs = exchange(port, f"/uvicorn/{shape}/{name}", close=close, expect=expect)
    assert ours.startswith(b"HTTP/1.1 200 OK\r\n")
    assert without_date(ours) == without_date(theirs)
    state = dict(app.state[f"/seam/{shape}/{name}"])
    writer = state.pop("writer", None)
    assert state == app.state[f"/uvicorn/{shape}/{name}"]
    if shape == "stream":
        assert writer == ChunkedWriter.__name__  # the head held, to leave with the first chunk
    assert app.written_here[f"/seam/{shape}/{name}"] is True  # (not uvicorn's send, whose bytes would match too)


@pytest.mark.parametrize("shape", ["stream", "whole"])
def test_heads_the_seam_leaves_to_uvicorn_come_out_as_uvicorn_writes_them(served, shape):
    port, app = served
    for name, method in (("connection", "GET"), ("none", "HEAD"), ("no-content", "GET")):
        ours = exchange(port, f"/seam/{shape}/{name}", method=method)
        theirs = exchange(port, f"/uvicorn/{shape}/{name}", method=method)
        assert without_date(ours) == without_date(theirs), (name, method)
        assert app.written_here[f"/seam/{shape}/{name}"] is False, (name, method)


@pytest.mark.parametrize("shape", ["stream", "whole"])
@pytest.mark.parametrize("name", ["bad-value", "bad-name", "newline-name"])
def test_a_header_uvicorn_refuses_is_refused_the_same_way(served, shape, name):
    port, app = served
    ours = exchange(port, f"/seam/{shape}/{name}")
    theirs = exchange(port, f"/uvicorn/{shape}/{name}")
    # uvicorn's send marks the response started before it checks the headers, so its answer to the
    # app's error is to close the connection: nothing of the head is written, by either
    assert ours == theirs == b""
    assert app.written_here[f"/seam/{shape}/{name}"] is False


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(re.sub(r":\d+ - ", ":PORT - ", record.getMessage()))


def test_where_uvicorns_access_log_is_on_the_seams_answers_have_their_line_too():
    app = Heads()
    protocol = ConnectionLimits(header_timeout=30, body_timeout=30, max_connections=100).protocol()
    access = logging.getLogger("uvicorn.access")
    seen = Lines()
    with serve_in_thread(app, http=protocol, access_log=True) as url:
        port = int(url.rsplit(":", 1)[1])
        access.addHandler(seen)  # (uvicorn's own handler writes to stdout; it does not propagate)
        level = access.level
        access.setLevel(logging.INFO)  # (serve_in_thread's log_level is warning)
        try:
            for who in ("seam", "uvicorn"):
                exchange(port, f"/{who}/stream/sse")
                exchange(port, f"/{who}/whole/tenant")
        finally:
            access.removeHandler(seen)
            access.setLevel(level)
    lines = seen.lines
    assert lines == [
        '127.0.0.1:PORT - "GET /seam/stream/sse HTTP/1.1" 200',
        '127.0.0.1:PORT - "GET /seam/whole/tenant HTTP/1.1" 200',
        '127.0.0.1:PORT - "GET /uvicorn/stream/sse HTTP/1.1" 200',
        '127.0.0.1:PORT - "GET /uvicorn/whole/tenant HTTP/1.1" 200',
    ]


def test_the_bytes_the_seam_refuses_in_a_head_are_the_ones_uvicorns_checks_refuse():
    """http.writers checks names and values with `bytes.translate` instead of uvicorn's two regular
    expressions (its HEADER_RE and HEADER_VALUE_RE): the same verdict for every byte."""
    for code in range(256):
        byte = bytes([code])
        assert (byte in writers.BAD_NAME_BYTES) == bool(HEADER_RE.search(byte)), code
        assert (byte in writers.BAD_VALUE_BYTES) == bool(HEADER_VALUE_RE.search(byte)), code


def test_without_uvicorns_default_headers_a_head_without_headers_is_still_uvicorns():
    app = Heads()
    protocol = ConnectionLimits(header_timeout=30, body_timeout=30, max_connections=100).protocol()
    with serve_in_thread(app, http=protocol, access_log=False, server_header=False, date_header=False) as url:
        port = int(url.rsplit(":", 1)[1])
        for shape in ("stream", "whole"):
            for name in ("none", "tenant"):
                ours = exchange(port, f"/seam/{shape}/{name}")
                assert ours == exchange(port, f"/uvicorn/{shape}/{name}"), (shape, name)
                assert ours.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n\r\n\r\n" not in ours
