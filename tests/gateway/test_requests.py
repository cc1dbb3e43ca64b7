"""What the gateway refuses itself (a table of bad requests), auth, request ids, and the plain happy paths."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from tests.gateway.conftest import chat_body, fast_settings, sse_events
from tests.support import wait_for

LIMIT = 4096
MESSAGES = [{"role": "user", "content": "hi"}]

# (name, path, method, body bytes or JSON, status, error code, param)
BAD_REQUESTS = [
    ("not json", "/v1/chat/completions", "POST", b"{nope", 400, "invalid_json", None),
    ("empty body", "/v1/chat/completions", "POST", b"", 400, "invalid_json", None),
    ("array body", "/v1/chat/completions", "POST", [1, 2], 400, "invalid_json", None),
    ("string body", "/v1/completions", "POST", "hello", 400, "invalid_json", None),
    (
        "missing model",
        "/v1/chat/completions",
        "POST",
        {"messages": MESSAGES},
        400,
        "missing_required_parameter",
        "model",
    ),
    (
        "model not a string",
        "/v1/chat/completions",
        "POST",
        {"model": 7, "messages": MESSAGES},
        400,
        "invalid_type",
        "model",
    ),
    ("empty model", "/v1/chat/completions", "POST", {"model": "", "messages": MESSAGES}, 400, "invalid_value", "model"),
    (
        "missing messages",
        "/v1/chat/completions",
        "POST",
        {"model": "standin"},
        400,
        "missing_required_parameter",
        "messages",
    ),
    (
        "messages not a list",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": "hi"},
        400,
        "invalid_type",
        "messages",
    ),
    (
        "no messages",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": []},
        400,
        "invalid_value",
        "messages",
    ),
    (
        "message not an object",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": ["hi"]},
        400,
        "invalid_type",
        "messages[0]",
    ),
    (
        "message without role",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": [{"content": "x"}]},
        400,
        "invalid_type",
        "messages[0].role",
    ),
    (
        "stream not a bool",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": MESSAGES, "stream": "yes"},
        400,
        "invalid_type",
        "stream",
    ),
    (
        "stream_options not an object",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": MESSAGES, "stream": True, "stream_options": True},
        400,
        "invalid_type",
        "stream_options",
    ),
    (
        "include_usage not a bool",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "y"}},
        400,
        "invalid_type",
        "stream_options.include_usage",
    ),
    (
        "user not a string",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": MESSAGES, "user": 5},
        400,
        "invalid_type",
        "user",
    ),
    ("missing prompt", "/v1/completions", "POST", {"model": "standin"}, 400, "missing_required_parameter", "prompt"),
    (
        "prompt not text",
        "/v1/completions",
        "POST",
        {"model": "standin", "prompt": {"a": 1}},
        400,
        "invalid_type",
        "prompt",
    ),
    (
        "empty prompt list",
        "/v1/completions",
        "POST",
        {"model": "standin", "prompt": []},
        400,
        "invalid_value",
        "prompt",
    ),
    (
        "body too large",
        "/v1/chat/completions",
        "POST",
        {"model": "standin", "messages": [{"role": "user", "content": "x" * LIMIT}]},
        413,
        "request_too_large",
        None,
    ),
    (
        "unknown model",
        "/v1/chat/completions",
        "POST",
        {"model": "gpt-9", "messages": MESSAGES},
        404,
        "model_not_found",
        "model",
    ),
    (
        "unknown model (completions)",
        "/v1/completions",
        "POST",
        {"model": "gpt-9", "prompt": "x"},
        404,
        "model_not_found",
        "model",
    ),
    ("unknown model card", "/v1/models/gpt-9", "GET", None, 404, "model_not_found", "model"),
    ("unknown path", "/v1/embeddings", "POST", {"model": "standin", "input": "x"}, 404, "not_found", None),
    ("wrong method", "/v1/chat/completions", "GET", None, 405, "method_not_allowed", None),
]


@pytest.fixture
def gw(engines, gateway):
    (engine,) = engines(1)
    return gateway(fast_settings({"standin": [engine.url]}, limits={"max_body_bytes": LIMIT}))


def test_bad_requests_get_the_right_status_and_the_openai_envelope(gw):
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for name, path, method, body, status, code, param in BAD_REQUESTS:
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            response = client.request(method, path, content=content, headers={"content-type": "application/json"})
            assert response.status_code == status, (name, response.text)
            payload = response.json()
            assert set(payload) == {"error"}, name
            error = payload["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert (error["code"], error["param"]) == (code, param), name
            assert error["message"] and isinstance(error["type"], str), name
            assert "Traceback" not in response.text
            assert response.headers["x-request-id"], name


def test_unknown_model_lists_the_known_ones(gw):
    response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="nope"))
    assert "standin" in response.json()["error"]["message"]


def test_body_too_large_is_refused_without_a_content_length(gw):
    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    response = httpx.post(f"{gw.url}/v1/chat/completions", content=chunks(), timeout=10)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_chat_completions_and_models_pass_through(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    models = httpx.get(f"{gw.url}/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("standin", 4096)]
    assert httpx.get(f"{gw.url}/v1/models/standin").json()["max_model_len"] == 4096

    body = chat_body(max_tokens=3)
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body).json()
    via = httpx.post(f"{gw.url}/v1/chat/completions", json=body).json()
    assert via["object"] == "chat.completion" and via["choices"] == direct["choices"]
    assert via["usage"] == direct["usage"]
    assert engine.stats()["last_request"]["body"] == body  # forwarded as sent

    completion = httpx.post(f"{gw.url}/v1/completions", json={"model": "standin", "prompt": "a b c", "max_tokens": 2})
    assert completion.json()["object"] == "text_completion"

    streamed = httpx.post(
        f"{gw.url}/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6


@pytest.mark.one_process("hands the gateway a Python callback for its request reports")
def test_request_ids_round_trip_to_the_engine_and_back(engines, gateway, caplog):
    (engine,) = engines(1)
    gw = gateway(
        fast_settings({"standin": [engine.url]}),
        log_request=lambda **f: logging.getLogger("test.access").info("%s", json.dumps(f)),
    )
    with caplog.at_level(logging.INFO, logger="test.access"):
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers={"x-request-id": "req-42"})
        assert response.headers["x-request-id"] == "req-42"
        assert engine.stats()["last_request"]["headers"]["x-request-id"] == "req-42"

        response = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True))
        made = response.headers["x-request-id"]
        assert len(made) == 32 and engine.stats()["last_request"]["headers"]["x-request-id"] == made
        assert httpx.post(f"{gw.url}/v1/chat/completions", content=b"{").headers["x-request-id"]

        def access_log() -> list[dict]:
            return [json.loads(r.getMessage()) for r in caplog.records if r.name == "test.access"]

        # Each line is written once its response went out, on the gateway's thread: wait for it.
        wait_for(lambda: len(access_log()) >= 3, what=access_log)
    logged = {entry["request_id"]: entry for entry in access_log()}
    assert len(logged) == 3
    plain, streamed = logged.pop("req-42"), logged.pop(made)
    assert streamed["stream"] is True and streamed["ttft_s"] > 0 and streamed["engine"]
    assert plain["prompt_tokens"] > 0 and plain["completion_tokens"] == 6
    (refused,) = logged.values()
    assert refused["status"] == 400 and refused["model"] is None


def test_api_keys_with_the_openai_sdk(engines, gateway, caplog):
    (engine,) = engines(1)
    gw = gateway(
        fast_settings({"standin": [engine.url]}, auth={"api_keys_env": "TEST_GW_KEYS"}),
        environ={"TEST_GW_KEYS": "sk-good-1,sk-good-2"},
    )
    with (
        caplog.at_level(logging.DEBUG),
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-good-2", max_retries=0) as good,
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-wrong-key", max_retries=0) as bad,
    ):
        assert good.chat.completions.create(model="standin", messages=MESSAGES).choices
        with pytest.raises(openai.AuthenticationError) as info:
            bad.chat.completions.create(model="standin", messages=MESSAGES)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert "sk-good-2" not in caplog.text and "sk-wrong-key" not in caplog.text
    assert engine.stats()["finished"] == 1
    missing = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body())
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "authorization" not in {k.lower() for k in engine.stats()["last_request"]["headers"]}
    for path in ("/health", "/ready", "/metrics"):  # ops endpoints stay open by default
        assert httpx.get(f"{gw.url}{path}").status_code == 200


def test_ops_endpoints_can_be_protected_too(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(
        fast_settings({"standin": [engine.url]}, auth={"api_keys_env": "K", "protect_ops_endpoints": True}),
        environ={"K": "sk-ops"},
    )
    assert httpx.get(f"{gw.url}/metrics").status_code == 401
    assert httpx.get(f"{gw.url}/metrics", headers={"authorization": "Bearer sk-ops"}).status_code == 200


def test_without_keys_of_its_own_the_gateway_passes_the_client_key_on(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(), headers={"authorization": "Bearer engine-key"})
    assert engine.stats()["last_request"]["headers"]["authorization"] == "Bearer engine-key"


def test_metrics_count_requests_first_tokens_and_usage(engines, gateway):
    (engine,) = engines(1, itl_ms=20)  # tokens far enough apart to leave the gateway one by one
    gw = gateway(fast_settings({"standin": [engine.url]}))
    httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}))
    httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body())
    httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="nope"))

    def scrape() -> tuple[str, dict[str, float]] | None:
        text = httpx.get(f"{gw.url}/metrics").text
        samples = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        counted = sum(v for k, v in samples.items() if k.startswith("gateway_requests_total{"))
        return (text, samples) if counted >= 3 else None  # each is counted just after its response

    text, samples = wait_for(scrape)
    assert samples['gateway_time_to_first_token_seconds_count{model="standin"}'] == 1  # streaming only
    # 6 tokens make 5 gaps, fewer if a busy machine delivers two tokens in one read.
    assert 1 <= samples['gateway_inter_token_latency_seconds_count{model="standin"}'] <= 5
    assert samples['gateway_requests_total{code="200",model="standin"}'] == 2
    assert samples['gateway_requests_total{code="404",model="_unknown"}'] == 1
    assert samples['gateway_completion_tokens_total{model="standin"}'] == 12
    assert samples['gateway_requests_in_flight{model="standin"}'] == 0
    assert 'gateway_engine_up{engine="' in text  # the engine scraper is wired in
