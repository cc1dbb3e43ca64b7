"""The real OpenAI Python SDK against the gateway in front of the real vLLM engine (tiny model)."""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest

from server.deploy.plan import served_model
from server.gateway.settings import GatewaySettings
from tests.gateway.conftest import WORKER_COUNTS, WORKER_IDS, served_gateway
from tests.support import wait_for

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Plan a day in Lisbon."}]
NO_EOS = {"ignore_eos": True}  # the tiny model's random weights may pick the end token early


@pytest.fixture(scope="module", params=WORKER_COUNTS, ids=WORKER_IDS)
def gateway_url(real_engine, request, tmp_path_factory):
    settings = GatewaySettings(auth={"api_keys_env": "TEST_REAL_ENGINE_GATEWAY_KEYS"})
    models = [served_model(real_engine.model, [real_engine.url], real_engine.profile)]
    log_dir = tmp_path_factory.mktemp("gateway")
    with served_gateway(
        settings, models, request.param, log_dir, environ={"TEST_REAL_ENGINE_GATEWAY_KEYS": "sk-test"}
    ) as gw:
        yield gw.url


@pytest.fixture
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-test", max_retries=0, timeout=60) as client:
        yield client


def test_models_list_carries_max_model_len(client, real_engine):
    models = client.models.list().data
    assert [m.id for m in models] == [real_engine.model]
    assert models[0].model_extra["max_model_len"] == real_engine.max_model_len


def test_chat(client, real_engine):
    answer = client.chat.completions.create(model=real_engine.model, messages=MESSAGES, max_tokens=8, extra_body=NO_EOS)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0


def test_streaming_with_usage(client, real_engine):
    chunks = list(
        client.chat.completions.create(
            model=real_engine.model,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completions(client, real_engine):
    answer = client.completions.create(
        model=real_engine.model, prompt="Once upon a time", max_tokens=5, extra_body=NO_EOS
    )
    assert answer.object == "text_completion" and answer.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=real_engine.model, prompt="Once", max_tokens=3, stream=True))
    assert streamed and all(c.object == "text_completion" for c in streamed)


def test_unknown_model_is_the_sdks_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"


def test_bad_requests_are_the_sdks_bad_request_error(client, real_engine):
    with pytest.raises(openai.BadRequestError) as info:  # refused by the gateway itself
        client.chat.completions.create(model=real_engine.model, messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):  # refused by vLLM, passed through
        client.chat.completions.create(model=real_engine.model, messages=MESSAGES, max_tokens=-1)


def test_wrong_key_is_the_sdks_authentication_error(gateway_url, real_engine):
    with (
        openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-nope", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.chat.completions.create(model=real_engine.model, messages=MESSAGES)


# -- usage the client did not ask for (proxy.hidden_usage) --------------------------------------------

GREEDY = {"ignore_eos": True, "temperature": 0}


def _sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def _token_counters(gateway_url: str, model: str) -> tuple[float, float]:
    text = httpx.get(f"{gateway_url}/metrics", timeout=30).text
    values = {}
    for name in ("prompt_tokens", "completion_tokens"):
        found = re.search(rf'^gateway_{name}_total\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
        values[name] = float(found.group(1)) if found else 0.0
    return values["prompt_tokens"], values["completion_tokens"]


def test_a_stream_without_include_usage_is_counted_and_reaches_the_client_unchanged(gateway_url, real_engine):
    body = {"model": real_engine.model, "messages": MESSAGES, "max_tokens": 7, "stream": True, **GREEDY}
    auth = {"authorization": "Bearer sk-test"}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{real_engine.url}/v1/chat/completions", json=body) as direct_response:
            direct = _sse(direct_response)
        asked = dict(body, stream_options={"include_usage": True})
        with http.stream("POST", f"{real_engine.url}/v1/chat/completions", json=asked) as asked_response:
            usage = _sse(asked_response)[-1]["usage"]
        before = _token_counters(gateway_url, real_engine.model)
        with http.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=auth) as through_response:
            through = _sse(through_response)
    # The gateway counted exactly what the engine reports for this request...
    expected = (before[0] + usage["prompt_tokens"], before[1] + usage["completion_tokens"])
    wait_for(lambda: _token_counters(gateway_url, real_engine.model) == expected)
    assert usage["completion_tokens"] == 7
    # ...and the client saw what a direct request without include_usage shows (chunk boundaries may
    # differ: vLLM coalesces tokens on a busy machine): the same text, the same kinds of chunks, no usage.
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in through)
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in direct)
    assert {frozenset(c) for c in through} == {frozenset(c) for c in direct}
    assert all(c["choices"] and "usage" not in c for c in through)
    assert through[-1]["choices"][0]["finish_reason"] == "length"
    assert through[-1]["system_fingerprint"] == direct[-1]["system_fingerprint"]
    assert [("system_fingerprint" in c) for c in through].count(True) == 1


# -- the client's x-request-id as vLLM's request id ----------------------------------------------------


def test_two_clients_choosing_the_same_request_id_do_not_collide_in_the_engine(gateway_url, real_engine):
    """vLLM 0.32 makes every request id unique inside the engine (it appends 8 random characters,
    vllm/v1/engine/input_processor.py `assign_request_id`, unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
    is set) and aborts a disconnected request by that internal id: so the gateway passes a client's
    `x-request-id` on (it names the request in vLLM's log) and this test says so. Were ids to collide,
    one stream would end early, fail, or carry the other's tokens, or the abandoned one would abort it."""
    headers = {"authorization": "Bearer sk-test", "x-request-id": "same-id-from-two-clients"}
    results: dict[str, tuple[int, str, list[dict]]] = {}
    started = {name: threading.Event() for name in ("a", "b")}

    def stream(name: str, content: str, tokens: int) -> None:
        body = {
            "model": real_engine.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        }
        with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
                    started[name].set()
            results[name] = (r.status_code, r.headers["x-request-id"], events)

    threads = [
        threading.Thread(target=stream, args=("a", "Plan a day in Lisbon.", 48)),
        threading.Thread(target=stream, args=("b", "Write about the sea and its colours.", 64)),
    ]
    for thread in threads:
        thread.start()
    for event in started.values():
        assert event.wait(120)
    # A third client with the same id leaves after its first chunk, while both others are generating.
    body = {"model": real_engine.model, "messages": MESSAGES, "max_tokens": 500, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        next(r.iter_lines())
    for thread in threads:
        thread.join(300)
    for name, tokens in (("a", 48), ("b", 64)):
        status, echoed, events = results[name]
        assert (status, echoed) == (200, "same-id-from-two-clients")
        assert not [e for e in events if "error" in e]
        assert events[-1]["usage"]["completion_tokens"] == tokens
        assert sum(1 for e in events if e["choices"] and e["choices"][0]["finish_reason"] == "length") == 1
        assert all(e["id"] == "chatcmpl-same-id-from-two-clients" for e in events)
