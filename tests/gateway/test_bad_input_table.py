"""Bad input and abusive clients (issue 15): one table, one gateway for all of it.

Every row is one hostile or broken request. Each is answered in the OpenAI error envelope with
the status in the table (a 4xx), or, for the slow ones, closed after the gateway's short
timeouts; a row whose request is fine but whose engine lies (negative usage) or whose work must
stay bounded (20,000 messages to trim) says what it checks instead. After every row the gateway
still answers a normal request and `gateway_requests_in_flight` is back to 0.

    row                      sent                                                answer
    deep-json-chat           chat body nested 1,000 deep                        400 invalid_json
    deep-json-completions    completions body nested 1,000 deep                 400 invalid_json
    bad-json / not-object    `{"model":` / `[1, 2]`                             400 invalid_json
    empty-body               nothing                                            400 invalid_json
    model-not-a-string       `"model": 7`                                       400 invalid_type
    unknown-model            a model nobody serves                              404 model_not_found
    8mb-model-name           an 8,000,000-character model name                  404, echo cut short
    bad-stream-flag          `"stream": "yes"`                                  400 invalid_type
    no-messages              `"messages": []`                                   400
    oversized-body           9 MiB (limit 8 MiB)                                413 request_too_large
    wrong-key / no-key       a wrong API key / none                             401 invalid_api_key
    unknown-route            POST /v1/nope                                      404 not_found
    wrong-method             GET /v1/chat/completions                           405 method_not_allowed
    trailing-slash-evil-host GET /metrics/ with Host: evil.example               404, no redirect
    bad-content-length       Content-Length: abc                                400 invalid_http
    cl-and-te                Content-Length and Transfer-Encoding                400 invalid_http
    bad-chunk-size           chunk size `zz`                                    400 invalid_http
    unknown-method           BREW                                               400 invalid_http
    tls-to-plain-port        a TLS ClientHello                                   400 invalid_http
    silent-connection        connects, sends nothing                            408 request_timeout, closed
    slowloris-headers        half the headers, then nothing                     408 request_timeout, closed
    slow-body                headers, part of the body, then nothing            closed, no answer
    too-many-headers         120 headers (limit 100)                            431 request_header_fields_too_large
    too-long-header-value    a 17 KiB header value (limit 16 KiB)               431 request_header_fields_too_large
    too-big-head             80 KiB of headers (limit 64 KiB in all)            431 request_header_fields_too_large
    many-messages            20,000 messages with trimming on                   200, <= 300 /tokenize calls
    negative-usage           an engine reporting usage -5/-1                    200 passed on, counted
    empty-key-list           GATEWAY keys "" or ","                             the gateway refuses to start

The connection caps (an idle connection let go at the cap, 503 too_many_connections, 429
too_many_connections_from_peer) are in tests/gateway/http/test_client_limits.py: they need a
gateway with caps of its own.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.config import SettingsError, TrimmingConfig
from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.settings import ModelEngines
from standin import StandinConfig, build_app
from tests.gateway.conftest import FAST_ENGINE, WORKER_COUNTS, WORKER_IDS, chat_body, fast_settings, served_gateway
from tests.support import WAIT_TIMEOUT, serve_in_thread, wait_for

KEY = "sk-table"
AUTH = {"authorization": f"Bearer {KEY}"}
SHORT = 0.3  # the gateway's header and body timeouts here: the slow rows end quickly


async def lying_engine(scope, receive, send) -> None:
    """An engine that answers every chat request with a negative usage (and 200 to everything else)."""
    if scope["type"] != "http":
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] != "/v1/chat/completions":
        await _answer(send, 200, b"{}", b"application/json")
        return
    usage = {"prompt_tokens": -5, "completion_tokens": -1, "total_tokens": -6}
    if not json.loads(raw).get("stream"):
        message = {"role": "assistant", "content": "hi"}
        answer = {"id": "x", "object": "chat.completion", "model": "liar", "usage": usage}
        answer["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
        await _answer(send, 200, json.dumps(answer).encode(), b"application/json")
        return
    chunk = {"id": "x", "object": "chat.completion.chunk", "model": "liar", "choices": []}
    stream = b"".join(
        b"data: " + json.dumps(event).encode() + b"\n\n"
        for event in (
            {**chunk, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]},
            {**chunk, "usage": usage},
        )
    )
    await _answer(send, 200, stream + b"data: [DONE]\n\n", b"text/event-stream")


async def _answer(send, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Table:
    """The module's gateway, its stand-in engine and its lying engine."""

    url: str
    engine_url: str

    def post(self, path: str, body: object = None, *, content: bytes | None = None, headers=None) -> httpx.Response:
        kwargs = {"content": content} if content is not None else {"json": body}
        return httpx.post(f"{self.url}{path}", headers={**AUTH, **(headers or {})}, timeout=WAIT_TIMEOUT, **kwargs)

    def raw(self, data: bytes, *, more: bytes | None = None) -> bytes:
        """Send `data` on a fresh connection and return everything until the gateway closes it."""
        parts = httpx.URL(self.url)
        with socket.create_connection((parts.host, parts.port), timeout=WAIT_TIMEOUT) as sock:
            if data:
                sock.sendall(data)
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):
                    received += chunk
            return received

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=WAIT_TIMEOUT).text


@pytest.fixture(scope="module", params=WORKER_COUNTS, ids=WORKER_IDS)
def table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Table]:
    with contextlib.ExitStack() as stack:
        standin = stack.enter_context(serve_in_thread(build_app(StandinConfig(**FAST_ENGINE, max_model_len=2048))))
        liar = stack.enter_context(serve_in_thread(lying_engine))
        settings = fast_settings(
            {"standin": [standin]},
            auth={"api_keys_env": "TABLE_KEYS"},
            limits={"header_timeout": SHORT, "body_timeout": SHORT},
        )
        settings.models = [
            ModelEngines(name="standin", urls=[standin], trimming=TrimmingConfig(mode="auto")),
            ModelEngines(name="liar", urls=[liar]),
        ]
        models = plan_deployment(settings.models).served_models()
        log_dir = tmp_path_factory.mktemp("table")
        gw = stack.enter_context(served_gateway(settings, models, request.param, log_dir, environ={"TABLE_KEYS": KEY}))
        yield Table(gw.url, standin)


# -- what the rows send ----------------------------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _http(status_line_and_headers: bytes, body: bytes = b"") -> bytes:
    return status_line_and_headers + b"\r\n" + body


def _parse(response: bytes) -> tuple[int | None, dict | None, bytes]:
    """(status, JSON body, head) of a raw HTTP response; (None, None, b"") when nothing came back."""
    if not response:
        return None, None, b""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body), head


Answer = tuple[int | None, dict | None]  # status and JSON body; (None, None): closed without an answer


def _json(response: httpx.Response) -> Answer:
    return response.status_code, response.json()


def _raw(response: bytes) -> Answer:
    status, body, _ = _parse(response)
    return status, body


def deep_chat(t: Table) -> Answer:
    body = b'{"model": "standin", "messages": [{"role": "user", "content": ' + _nested(1000).encode() + b"}]}"
    return _json(t.post("/v1/chat/completions", content=body))


def deep_completions(t: Table) -> Answer:
    return _json(t.post("/v1/completions", content=b'{"model": "standin", "prompt": %s}' % _nested(1000).encode()))


def eight_mb_model_name(t: Table) -> Answer:
    response = t.post("/v1/chat/completions", chat_body(model="m" * 8_000_000))
    assert len(response.content) < 1_000  # the name is echoed cut short, not in full
    return _json(response)


def oversized(t: Table) -> Answer:
    return _json(t.post("/v1/chat/completions", content=b'{"model": "standin", "x": "' + b"a" * (9 << 20) + b'"}'))


def trailing_slash_evil_host(t: Table) -> Answer:
    response = httpx.get(f"{t.url}/metrics/", headers={**AUTH, "host": "evil.example"}, timeout=WAIT_TIMEOUT)
    assert "location" not in response.headers
    return _json(response)


def slow_body(t: Table) -> Answer:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
        b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model": ' % KEY.encode()
    )
    return _raw(t.raw(head))


def many_messages(t: Table) -> Answer:
    calls = httpx.get(f"{t.engine_url}/_standin/stats", timeout=WAIT_TIMEOUT).json()["tokenize_calls"]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20_001)]
    response = t.post("/v1/chat/completions", {"model": "standin", "messages": messages, "max_tokens": 4})
    made = httpx.get(f"{t.engine_url}/_standin/stats", timeout=WAIT_TIMEOUT).json()["tokenize_calls"] - calls
    assert made <= 300, f"{made} /tokenize calls for one request"
    assert int(response.headers["x-trimmed-messages"]) > 0
    return _json(response)


def negative_usage(t: Table) -> Answer:
    def counted() -> float:
        found = re.search(r'^gateway_requests_total\{code="200",model="liar"\} (\S+)$', t.metrics(), re.M)
        return float(found.group(1)) if found else 0.0

    before = counted()
    streamed = t.post("/v1/chat/completions", chat_body(model="liar", stream=True))
    assert streamed.status_code == 200 and b"[DONE]" in streamed.content
    plain = t.post("/v1/chat/completions", chat_body(model="liar"))
    wait_for(lambda: counted() == before + 2)  # both in requests_total despite the engine's numbers
    return _json(plain)


def empty_key_list(t: Table) -> Answer:
    settings = fast_settings({"standin": [t.engine_url]}, auth={"api_keys_env": "EMPTY_KEYS"})
    for value in ("", ",", " , "):
        with pytest.raises(SettingsError, match="holds no API key"):
            create_app(
                settings,
                plan_deployment(settings.models).served_models(),
                registry=CollectorRegistry(),
                environ={"EMPTY_KEYS": value},
            )
    return 0, None  # nothing was served: there is no gateway to answer


POST_CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"


BREW = b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n"
TLS_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n"
WRONG_KEY = {"authorization": "Bearer sk-wrong"}


def _headers(count: int, value_bytes: int) -> bytes:
    """A chat request's head with `count` extra headers of `value_bytes` each (the defaults' caps)."""
    return POST_CHAT + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * value_bytes) for i in range(count)) + b"\r\n"


@dataclass(frozen=True)
class Row:
    name: str
    send: Callable[[Table], Answer]
    status: int | None  # None: closed without an answer
    code: str | None = None  # the envelope's `code`, when there is an envelope to check


def _post(path: str, body: object = None, *, content: bytes | None = None, headers=None):
    return lambda t: _json(t.post(path, body, content=content, headers=headers))


ROWS = [
    Row("deep-json-chat", deep_chat, 400, "invalid_json"),
    Row("deep-json-completions", deep_completions, 400, "invalid_json"),
    Row("bad-json", _post("/v1/chat/completions", content=b'{"model":'), 400, "invalid_json"),
    Row("not-an-object", _post("/v1/chat/completions", content=b"[1, 2]"), 400, "invalid_json"),
    Row("empty-body", _post("/v1/chat/completions", content=b""), 400, "invalid_json"),
    Row("model-not-a-string", _post("/v1/chat/completions", chat_body(model=7)), 400, "invalid_type"),
    Row("unknown-model", _post("/v1/chat/completions", chat_body(model="nope")), 404, "model_not_found"),
    Row("8mb-model-name", eight_mb_model_name, 404, "model_not_found"),
    Row("bad-stream-flag", _post("/v1/chat/completions", chat_body(stream="yes")), 400, "invalid_type"),
    Row("no-messages", _post("/v1/chat/completions", chat_body(messages=[])), 400, None),
    Row("oversized-body", oversized, 413, "request_too_large"),
    Row(
        "wrong-key",
        _post("/v1/chat/completions", chat_body(), headers={"authorization": "Bearer no"}),
        401,
        "invalid_api_key",
    ),
    Row("no-key", _post("/v1/chat/completions", chat_body(), headers={"authorization": ""}), 401, "invalid_api_key"),
    Row("unknown-route", _post("/v1/nope", chat_body()), 404, "not_found"),
    Row(
        "wrong-method",
        lambda t: _json(httpx.get(f"{t.url}/v1/chat/completions", headers=AUTH, timeout=WAIT_TIMEOUT)),
        405,
        "method_not_allowed",
    ),
    Row("trailing-slash-evil-host", trailing_slash_evil_host, 404, "not_found"),
    Row(
        "bad-content-length", lambda t: _raw(t.raw(_http(POST_CHAT + b"content-length: abc\r\n"))), 400, "invalid_http"
    ),
    Row(
        "cl-and-te",
        lambda t: _raw(t.raw(_http(POST_CHAT + b"content-length: 5\r\ntransfer-encoding: chunked\r\n", b"0\r\n\r\n"))),
        400,
        "invalid_http",
    ),
    Row(
        "bad-chunk-size",
        lambda t: _raw(t.raw(_http(POST_CHAT + b"transfer-encoding: chunked\r\n", b"zz\r\nabc\r\n"))),
        400,
        "invalid_http",
    ),
    Row(
        "unknown-method",
        lambda t: _raw(t.raw(b"BREW /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n")),
        400,
        "invalid_http",
    ),
    Row(
        "tls-to-plain-port",
        lambda t: _raw(t.raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n")),
        400,
        "invalid_http",
    ),
    Row("silent-connection", lambda t: _raw(t.raw(b"")), 408, "request_timeout"),
    Row("slowloris-headers", lambda t: _raw(t.raw(POST_CHAT)), 408, "request_timeout"),
    Row("slow-body", slow_body, None),
    Row("too-many-headers", lambda t: _raw(t.raw(_headers(120, 8))), 431, "request_header_fields_too_large"),
    Row("too-long-header-value", lambda t: _raw(t.raw(_headers(1, 17 << 10))), 431, "request_header_fields_too_large"),
    Row("too-big-head", lambda t: _raw(t.raw(_headers(40, 2 << 10))), 431, "request_header_fields_too_large"),
    Row("many-messages", many_messages, 200),
    Row("negative-usage", negative_usage, 200),
    Row("empty-key-list", empty_key_list, 0),
]


def _in_flight(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^gateway_requests_in_flight\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_bad_input_is_refused_in_the_envelope_and_the_gateway_keeps_serving(table, row):
    status, body = row.send(table)
    assert status == row.status
    if status is not None and 400 <= status < 500:
        assert body is not None and set(body) == {"error"}
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["type"] == "invalid_request_error"
        if row.code is not None:
            assert error["code"] == row.code
        if row.code is None and status in (400, 401):
            assert error["code"]  # some code, whatever the check that refused it calls it
    # The gateway still serves, and nothing stays in flight.
    assert table.post("/v1/chat/completions", chat_body()).status_code == 200
    wait_for(lambda: _in_flight(table.metrics()) == 0, what=lambda: table.metrics())
