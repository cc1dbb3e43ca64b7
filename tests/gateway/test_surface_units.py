"""The pure parts behind the endpoints beyond chat: the endpoint table, upload forms, response ids,
the Responses SSE dialect, and engine errors put in the envelope."""

from __future__ import annotations

import json

import pytest

from server.gateway.errors import (
    InvalidRequest,
    ModelNotFound,
    ResponseNotFound,
    UpstreamFailed,
    engine_error_body,
)
from server.gateway.http.sse import UsageScanner
from server.gateway.http.streams import RESPONSES, responses_has_token
from server.gateway.observability.record import token_counts
from server.gateway.replicas.engine import Engine
from server.gateway.replicas.pool import EnginePool, ModelPool
from server.gateway.request.endpoints import BY_PATH, ENDPOINTS, OTHERS, known_path, match
from server.gateway.request.forms import form_fields
from server.gateway.request.request import parse_request
from server.gateway.request.targets import body_for, excluded, resolve

# -- the table ------------------------------------------------------------------------------------


def test_every_path_of_the_issue_is_in_the_table_once_per_method():
    paths = {(e.method, e.path) for e in ENDPOINTS}
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{response_id}/cancel",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    ):
        assert ("POST", path) in paths
    assert ("GET", "/v1/responses/{response_id}") in paths
    assert len(paths) == len(ENDPOINTS)


def test_matching_paths_with_a_response_id():
    retrieve = match("/v1/responses/resp_1", "GET")
    assert retrieve is not None and retrieve[0].name == "responses_retrieve" and retrieve[1] == "resp_1"
    cancel = match("/v1/responses/resp_1/cancel", "POST")
    assert cancel is not None and cancel[0].name == "responses_cancel" and cancel[1] == "resp_1"
    assert match("/v1/responses/", "GET") is None
    assert match("/v1/responses/a/b", "GET") is None
    assert match("/v1/responses/resp_1", "POST") is None  # not an endpoint: 405
    assert known_path("/v1/responses/resp_1") and known_path("/v1/embeddings") and not known_path("/v1/x")
    assert all(e.method == "POST" and "{" not in e.path for e in BY_PATH.values())
    assert {e.name for e in OTHERS} == {"responses_retrieve", "responses_cancel"}


# -- upload forms ---------------------------------------------------------------------------------


def multipart(boundary: str, *parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_form_fields_skip_files_and_take_the_first_value():
    body = multipart(
        "XyZ",
        ("file", "model.wav", b'name="model"\r\n\r\nfake'),
        ("model", None, b"whisper"),
        ("stream", None, b"true"),
        ("model", None, b"second"),
    )
    assert form_fields(body, 'multipart/form-data; boundary="XyZ"', frozenset({"model", "stream"})) == {
        "model": "whisper",
        "stream": "true",
    }
    assert form_fields(b"model=a&x=1", "application/x-www-form-urlencoded", frozenset({"model"})) == {"model": "a"}


@pytest.mark.parametrize("content_type", ["multipart/form-data", "application/json", None])
def test_form_fields_refuse_what_is_not_a_form(content_type):
    with pytest.raises(InvalidRequest):
        form_fields(b"{}", content_type, frozenset({"model"}))


def test_a_form_request_keeps_the_clients_content_type_and_bytes():
    endpoint = BY_PATH["/v1/audio/transcriptions"]
    body = multipart("b1", ("model", None, b"whisper"), ("stream", None, b"true"), ("file", "a.wav", b"\x00\x01"))
    headers = [(b"content-type", b"multipart/form-data; boundary=b1")]
    request = parse_request(body, endpoint, headers=headers)
    assert (request.model, request.stream, request.raw) == ("whisper", True, body)
    assert request.content_type == b"multipart/form-data; boundary=b1"
    with pytest.raises(InvalidRequest) as info:
        parse_request(multipart("b1", ("file", "a.wav", b"x")), endpoint, headers=headers)
    assert info.value.param == "model"


# -- response ids and where requests go ------------------------------------------------------------


def pools() -> EnginePool:
    a, b = Engine("chat", "http://10.0.0.1:8100"), Engine("chat", "http://10.0.0.2:8100")
    embed = Engine("embed", "http://10.0.0.3:8100")
    b.adapters["travel"] = {"id": "travel", "parent": "chat"}
    return EnginePool([ModelPool("chat", [a, b]), ModelPool("embed", [embed])])


def test_a_continuation_is_routed_like_any_request_and_sent_as_it_was_built():
    upstreams = pools()
    create = parse_request(
        json.dumps({"model": "chat", "input": "x", "previous_response_id": "resp_1"}).encode(), BY_PATH["/v1/responses"]
    )
    assert resolve(upstreams, create) is upstreams.models["chat"] and create.pin is None
    assert excluded(create, upstreams.models["chat"]) == []  # any replica (app.responses sent it stateless)
    assert body_for(create, upstreams.models["chat"].engines[0]) == create.raw


def test_a_retrieve_that_reaches_the_router_is_404_no_engine_keeps_responses():
    endpoint, param = match("/v1/responses/resp_1", "GET") or (None, "")
    assert endpoint is not None
    retrieve = parse_request(b"", endpoint, param=param, path="/v1/responses/resp_1")
    with pytest.raises(ResponseNotFound, match="the gateway's"):
        resolve(pools(), retrieve)


def test_resolve_sends_adapters_to_their_base_model_only_where_served():
    upstreams = pools()
    request = parse_request(b'{"model": "travel", "prompt": "x"}', BY_PATH["/v1/completions"])
    assert resolve(upstreams, request) is upstreams.models["chat"] and request.adapter == "travel"
    assert excluded(request, upstreams.models["chat"]) == [upstreams.models["chat"].engines[0]]
    with pytest.raises(ModelNotFound, match="travel"):
        resolve(upstreams, parse_request(b'{"model": "nope", "prompt": "x"}', BY_PATH["/v1/completions"]))


def test_only_responses_creates_get_a_body_per_engine():
    upstreams = pools()
    raw = b'{"model": "embed", "input": "x"}'
    request = parse_request(raw, BY_PATH["/v1/embeddings"])
    assert body_for(request, upstreams.models["embed"].engines[0]) is raw


# -- the Responses dialect --------------------------------------------------------------------------


def event(kind: str, number: int, **fields: object) -> bytes:
    payload = json.dumps({**fields, "sequence_number": number, "type": kind})
    return f"event: {kind}\ndata: {payload}\n\n".encode()


def test_responses_tokens_are_delta_events_only():
    assert responses_has_token(event("response.output_text.delta", 4, delta="hi"))
    assert responses_has_token(event("response.function_call_arguments.delta", 4, delta='{"a'))
    assert not responses_has_token(event("response.output_text.done", 5, text='ends with .delta"'))
    assert not responses_has_token(event("response.created", 0, response={"text": None}))


def test_responses_usage_comes_from_response_completed_even_split_across_reads():
    scanner = UsageScanner()
    created = event("response.created", 0, response={"usage": None})
    completed = event("response.completed", 9, response={"id": "r", "usage": {"input_tokens": 15, "output_tokens": 3}})
    scanner.feed(created + completed[:40])
    scanner.feed(completed[40:])
    usage = scanner.finish()
    assert usage is not None and token_counts(usage) == (15, 3)
    assert token_counts({"prompt_tokens": 4, "total_tokens": 4}) == (4, None)


def test_responses_error_event_follows_the_last_sequence_number():
    last = event("response.output_text.delta", 6, delta="x") + event("response.output_text.delta", 7, delta="y")
    text = RESPONSES.error_event(UpstreamFailed("engine died"), last).decode()
    assert text.startswith("event: error\ndata: ") and text.endswith("\n\n")
    payload = json.loads(text.split("data: ", 1)[1])
    assert payload == {
        "type": "error",
        "code": "upstream_failed",
        "message": "engine died",
        "param": None,
        "sequence_number": 8,
    }
    assert RESPONSES.finished(event("response.completed", 9, response={}))
    assert not RESPONSES.finished(last)


# -- engine errors in the envelope ------------------------------------------------------------------


def test_engine_errors_that_are_not_envelopes_are_put_in_one():
    envelope = json.loads(engine_error_body(404, b'{"detail":"Not Found"}') or b"")
    assert envelope == {
        "error": {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": "not_found"}
    }
    unauthorized = json.loads(engine_error_body(401, b'{"error":"Unauthorized"}') or b"")
    assert unauthorized["error"]["message"] == "Unauthorized" and unauthorized["error"]["code"] == "invalid_api_key"
    assert json.loads(engine_error_body(500, b"Internal Server Error") or b"")["error"]["type"] == "server_error"
    assert engine_error_body(400, b'{"error": {"message": "x", "type": "BadRequestError", "code": 400}}') is None
