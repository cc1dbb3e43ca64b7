"""The streaming client against real servers: timings, usage, and every error kind."""

import asyncio
import json
import time

import httpx
import pytest

from loadtest.client import ChatClient, make_transport, normalize_base_url
from loadtest.records import RequestRecord
from tests.support import free_port, serve_in_thread

MESSAGES = [{"role": "user", "content": "plan a day in Lisbon"}]


@pytest.fixture(params=["raw", "httpx"])
def kind(request):
    """Every client test runs on both HTTP machineries."""
    return request.param


async def stream(url, *, max_tokens=8, timeout=10.0, extra=None, model="standin", hook=None, kind="raw"):
    async with make_transport(kind, max_connections=4, timeout_s=timeout) as http:
        client = ChatClient(
            url,
            http=http,
            model=model,
            timeout_s=timeout,
            extra_body=extra,
            headers={"x-test": "1"},
            record_headers=("X-Request-Id", "x-none"),
        )
        record = RequestRecord(request_id="req-1", session_id="s-1", max_tokens=max_tokens)
        origin = time.perf_counter()
        answer = await client.stream(record, MESSAGES, origin=origin, on_first_token=hook)
        return answer.record, answer.text


def test_base_url_with_or_without_v1():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert normalize_base_url(url) == "http://h:1"


async def test_chunk_timings_usage_and_text(standin, kind):
    fired = []
    record, text = await stream(standin + "/v1", max_tokens=8, hook=lambda: fired.append(1), kind=kind)
    assert record.ok and record.done and record.status == 200
    assert record.completion_tokens == 8 and record.tokens_from_usage
    assert record.prompt_tokens > 0
    assert len(text.split()) == 8 and record.output_chars == len(text)
    assert fired == [1]
    # stand-in: first token 30 ms after arrival, then one every 5 ms
    assert record.ttft_s >= 0.030
    assert len(record.chunk_s) == 8 and record.chunk_s[0] == record.ttft_s
    gaps = [b - a for a, b in zip(record.chunk_s, record.chunk_s[1:])]
    assert all(g >= 0 for g in gaps)
    # chunks cannot arrive before they are sent: the last one left >= 35 ms after the first,
    # so they were timed one by one on arrival, not all at the end (lower bound only: a busy
    # machine delays, it never hurries)
    assert record.chunk_s[-1] - record.chunk_s[0] >= 0.035 - (record.ttft_s - 0.030)
    assert record.e2e_s == record.chunk_s[-1] <= record.closed_s
    assert record.first_chunk_s <= record.ttft_s
    assert record.finish_reason == "length"
    assert record.headers == {"x-request-id": "req-1"}  # asked-for response headers kept


async def test_request_carries_stream_options_and_headers(standin, kind):
    await stream(standin, extra={"temperature": 0}, kind=kind)
    last = httpx.get(f"{standin}/_standin/stats").json()["last_request"]
    body = last["body"] if isinstance(last["body"], dict) else json.loads(last["body"])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["temperature"] == 0
    headers = {k.lower(): v for k, v in last["headers"].items()}
    assert headers["x-request-id"] == "req-1" and headers["x-correlation-id"] == "s-1"
    assert headers["x-test"] == "1"


async def test_http_error_status_with_message(standin, kind):
    httpx.post(f"{standin}/_standin/faults", json={"status": 503})
    record, _ = await stream(standin, kind=kind)
    assert record.error_kind == "http" and record.status == 503
    assert "HTTP 503" in record.error and "stand-in fault" in record.error


async def test_unknown_model_is_an_http_error(standin, kind):
    record, _ = await stream(standin, model="nope", kind=kind)
    assert record.error_kind == "http" and record.status in (400, 404)


async def test_connection_cut_mid_stream_is_truncated(standin, kind):
    record, text = await stream(standin, extra={"standin": {"die_after_chunks": 3}}, kind=kind)
    assert record.error_kind == "truncated"
    assert record.status == 200 and not record.done
    assert record.ttft_s is not None  # the chunks before the cut were timed


async def test_timeout_before_first_byte(standin, kind):
    started = time.perf_counter()
    record, _ = await stream(standin, timeout=0.3, extra={"standin": {"first_byte_delay_s": 3}}, kind=kind)
    assert record.error_kind == "timeout"
    assert time.perf_counter() - started < 2.0


async def test_timeout_in_a_stalled_stream(standin, kind):
    record, _ = await stream(
        standin, timeout=0.4, extra={"standin": {"stall_after_chunks": 2, "stall_s": 3}}, kind=kind
    )
    assert record.error_kind == "timeout" and record.status == 200


async def test_connection_refused(kind):
    record, _ = await stream(f"http://127.0.0.1:{free_port()}", kind=kind)
    assert record.error_kind == "connection" and record.status is None


def sse_app(events: list[bytes]):
    """A tiny ASGI app answering every request with these raw SSE bytes."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b""})

    return app


def chunk(content=None, role=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return ("data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}) + "\n\n").encode()


def test_error_event_inside_a_200_stream(kind):
    error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
    with serve_in_thread(sse_app([chunk("", "assistant"), chunk("hi"), error, b"data: [DONE]\n\n"])) as url:
        record, text = asyncio.run(stream(url, kind=kind))
    assert record.error_kind == "stream_error" and "engine died" in record.error
    assert text == "hi"


def test_stream_ending_without_done_is_truncated(kind):
    with serve_in_thread(sse_app([chunk("a"), chunk("b")])) as url:
        record, _ = asyncio.run(stream(url, kind=kind))
    assert record.error_kind == "truncated" and "[DONE]" in record.error


def test_ttft_waits_for_text_and_tokens_fall_back_to_chunks(kind):
    # role chunk, an empty token chunk (partial UTF-8 in vLLM), then text; no usage chunk
    with serve_in_thread(
        sse_app([chunk("", "assistant"), chunk(""), chunk("x"), chunk("y"), b": keep-alive\n\n", b"data: [DONE]\n\n"])
    ) as url:
        record, text = asyncio.run(stream(url, kind=kind))
    assert record.ok and text == "xy"
    assert record.first_chunk_s < record.ttft_s
    assert len(record.chunk_s) == 2  # ITL from the TTFT chunk on
    assert record.completion_tokens == 3 and not record.tokens_from_usage


def test_a_stream_without_tokens_is_an_error(kind):
    with serve_in_thread(sse_app([chunk("", "assistant"), b"data: [DONE]\n\n"])) as url:
        record, _ = asyncio.run(stream(url, kind=kind))
    assert record.error_kind == "no_tokens"


async def test_raw_transport_reuses_keep_alive_connections(standin):
    from loadtest.transport import HTTPClient

    async with HTTPClient(max_connections=2) as http:
        client = ChatClient(standin, http=http, model="standin", timeout_s=10)
        for i in range(4):
            answer = await client.stream(
                RequestRecord(request_id=f"k{i}", max_tokens=2), MESSAGES, origin=time.perf_counter()
            )
            assert answer.record.ok
        assert len(http._open) == 1  # one connection, reused


def test_raw_transport_replaces_a_connection_the_server_closed_while_idle():
    """uvicorn closes idle keep-alive connections after 1 s here; the next request still works."""
    from loadtest.transport import HTTPClient

    async def go(url):
        async with HTTPClient(max_connections=1) as http:
            client = ChatClient(url, http=http, model="standin", timeout_s=10)
            first = await client.stream(
                RequestRecord(request_id="a", max_tokens=2), MESSAGES, origin=time.perf_counter()
            )
            (idle,) = http._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]), False)]
            deadline = time.monotonic() + 30
            while not idle.closed and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # poll until the server has closed it
            assert idle.closed
            second = await client.stream(
                RequestRecord(request_id="b", max_tokens=2), MESSAGES, origin=time.perf_counter()
            )
            return first.record, second.record

    from standin import StandinConfig, build_app

    app = build_app(StandinConfig(ttft_ms=1, itl_ms=1, tokens=2))
    with serve_in_thread(app, timeout_keep_alive=1) as url:
        first, second = asyncio.run(go(url))
    assert first.ok and second.ok


async def test_raw_transport_reads_an_answer_that_ends_where_the_connection_does():
    """Neither content-length nor chunks (an HTTP/1.0 server, or one that closes): the body is what
    came before the close; a chunked answer cut by a close is still a broken one."""
    from loadtest.transport import HTTPClient, ProtocolError

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        cut = (await reader.readexactly(1)) == b"y"
        writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n"
            if cut
            else b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: hel\n\ndata: lo\n\n"
        )
        await writer.drain()
        writer.close()

    async def read(http, url, body):
        response = await http.post(url, {}, body)
        parts = []
        try:
            while (chunk := await response.next_chunk()) is not None:
                parts.append(chunk[0])
        finally:
            await response.aclose()
        return b"".join(parts)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    async with HTTPClient(max_connections=2) as http:
        assert await read(http, url, b"x") == b"data: hel\n\ndata: lo\n\n"
        assert not any(http._idle.values())  # closed by the server: not kept for another request
        with pytest.raises(ProtocolError):
            await read(http, url, b"y")
    server.close()
    await server.wait_closed()


def test_raw_transport_speaks_https(tmp_path):
    import ssl
    import subprocess

    from loadtest.transport import HTTPClient
    from standin import StandinConfig, build_app

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    trust = ssl.create_default_context(cafile=str(cert))

    async def go(url):
        async with HTTPClient(max_connections=1, tls=trust) as http:
            client = ChatClient(url, http=http, model="standin", timeout_s=10)
            answer = await client.stream(
                RequestRecord(request_id="tls", max_tokens=3), MESSAGES, origin=time.perf_counter()
            )
            return answer.record

    app = build_app(StandinConfig(ttft_ms=1, itl_ms=1, tokens=3))
    with serve_in_thread(app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as url:
        record = asyncio.run(go(url.replace("http://", "https://")))
    assert record.ok and record.completion_tokens == 3
