"""The stand-in engine answers like vLLM 0.32 and its faults and counters do what they say."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator

import httpx
import pytest

from standin import StandinConfig, build_app, count_chat_tokens, count_prompt_tokens
from tests.support import raw_post, serve_in_thread, wait_for

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Plan a day in Lisbon"},
]


@pytest.fixture
def standin() -> Iterator[tuple[str, object]]:
    app = build_app(StandinConfig(model="m", ttft_ms=1, itl_ms=1, tokens=5, max_model_len=256))
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=httpx.Timeout(10.0)) as http:
        yield http


def sse_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def stats(client: httpx.Client, url: str) -> dict:
    return client.get(f"{url}/_standin/stats").json()


def test_token_counting_is_words_plus_fixed_costs():
    assert count_chat_tokens(MESSAGES) == (4 + 3) + (4 + 5) + 3
    assert count_chat_tokens(MESSAGES, add_generation_prompt=False) == (4 + 3) + (4 + 5)
    assert count_chat_tokens([{"role": "user", "content": [{"type": "text", "text": "a b"}]}]) == 4 + 2 + 3
    assert count_prompt_tokens("one two three") == 3
    assert count_prompt_tokens([7, 8]) == 2


def test_chat_completion_has_vllm_shape_usage_and_request_id(standin, client):
    url, _ = standin
    response = client.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES},
        headers={"x-request-id": "req-42"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-42"
    assert int(response.headers["content-length"]) == len(response.content)
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["id"] == "chatcmpl-req-42"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": count_chat_tokens(MESSAGES),
        "completion_tokens": 5,
        "total_tokens": count_chat_tokens(MESSAGES) + 5,
        "prompt_tokens_details": None,
    }


def test_chat_stream_role_chunk_tokens_usage_then_done(standin, client):
    url, _ = standin
    request = {
        "model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 3,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    with client.stream("POST", f"{url}/v1/chat/completions", json=request) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 3
    assert [chunk["choices"][0]["finish_reason"] for chunk in tokens] == [None, None, "length"]
    assert all(chunk["choices"][0]["delta"]["content"] for chunk in tokens)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens"] == count_chat_tokens(MESSAGES)


def test_stream_without_include_usage_has_no_usage_chunk(standin, client):
    url, _ = standin
    request = {"model": "m", "messages": MESSAGES, "stream": True}
    with client.stream("POST", f"{url}/v1/chat/completions", json=request) as response:
        events = sse_events(response.iter_lines())
    assert len(events) == 1 + 5 + 1
    assert all("usage" not in json.loads(event) for event in events[:-1])


def test_completions_stream_and_plain(standin, client):
    url, _ = standin
    plain = client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "a b c", "max_tokens": 2}).json()
    assert plain["object"] == "text_completion"
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"]["prompt_tokens"] == 3 and plain["usage"]["completion_tokens"] == 2
    request = {"model": "m", "prompt": "a b c", "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{url}/v1/completions", json=request) as response:
        events = sse_events(response.iter_lines())
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]"
    assert [chunk["object"] for chunk in chunks] == ["text_completion"] * 6
    assert all(chunk["choices"][0]["text"] for chunk in chunks[:5])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_tokenize_matches_usage_and_reports_max_model_len(standin, client):
    url, _ = standin
    counted = client.post(f"{url}/tokenize", json={"model": "m", "messages": MESSAGES}).json()
    assert counted["count"] == count_chat_tokens(MESSAGES) == len(counted["tokens"])
    assert counted["max_model_len"] == 256
    bare = client.post(f"{url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] == counted["count"] - 3
    assert client.post(f"{url}/tokenize", json={"prompt": "x y"}).json()["count"] == 2
    usage = client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}).json()["usage"]
    assert usage["prompt_tokens"] == counted["count"]
    assert stats(client, url)["tokenize_calls"] == 3
    assert stats(client, url)["last_tokenize"]["body"] == {"prompt": "x y"}


def test_models_health_and_metrics(standin, client):
    url, _ = standin
    models = client.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    assert [(card["id"], card["max_model_len"]) for card in models["data"]] == [("m", 256)]
    assert client.get(f"{url}/health").status_code == 200
    metrics = client.get(f"{url}/metrics").text
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    ):  # fmt: skip
        assert f"\n{name}{{" in metrics
    assert client.get(f"{url}/nope").status_code == 404
    assert client.get(f"{url}/v1/chat/completions").status_code == 405


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, "body"),
        (b"[1]", 400, "body"),
        (b'{"model": "m"}', 400, "body.messages"),
        (b'{"model": "m", "messages": "hi"}', 400, "body.messages"),
        (b'{"model": "other", "messages": []}', 404, "model"),
        (b'{"messages": [], "max_tokens": 999}', 400, "max_tokens"),
        (b'{"messages": [], "max_tokens": 254}', 400, "input_tokens"),  # 3 + 254 > 256
        (b'{"messages": [{"role": "user", "content": "' + b"w " * 300 + b'"}]}', 400, "input_tokens"),
    ],
)
def test_bad_requests_get_the_openai_envelope(standin, client, body, status, param):
    url, _ = standin
    response = client.post(f"{url}/v1/chat/completions", content=body, headers={"x-request-id": "bad-1"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert response.headers["x-request-id"] == "bad-1"
    assert stats(client, url)["rejected"] == 1 and stats(client, url)["started"] == 0


def test_prompt_plus_max_tokens_within_the_limit_is_accepted(standin, client):
    url, _ = standin
    response = client.post(f"{url}/v1/chat/completions", json={"messages": [], "max_tokens": 253})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5


def test_last_request_and_counters(standin, client):
    url, _ = standin
    client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "user": "u1"}, headers={"x-a": "b"})
    client.post(f"{url}/v1/completions", json={"prompt": "p"})
    seen = stats(client, url)
    assert seen["started"] == 2 and seen["finished"] == 2 and seen["running"] == 0 and seen["aborted"] == 0
    assert seen["requests"] == {"/v1/chat/completions": 1, "/v1/completions": 1}
    assert seen["last_request"]["path"] == "/v1/completions"
    client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "user": "u1"}, headers={"x-a": "b"})
    last = stats(client, url)["last_request"]
    assert last["body"] == {"messages": MESSAGES, "user": "u1"}
    assert last["headers"]["x-a"] == "b"
    assert client.delete(f"{url}/_standin/stats").json()["started"] == 0


def test_per_request_token_override_and_prefix_cache_hits(standin, client):
    url, _ = standin
    long_history = [{"role": "user", "content": " ".join(f"w{i}" for i in range(64))}]
    request = {"messages": long_history, "standin": {"tokens": 2}}
    first = client.post(f"{url}/v1/chat/completions", json=request).json()
    assert first["usage"]["completion_tokens"] == 2
    client.post(f"{url}/v1/chat/completions", json=request)
    metrics = client.get(f"{url}/metrics").text
    hits = next(line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
    assert float(hits.rsplit(" ", 1)[1]) >= 48
    rejected = client.post(f"{url}/v1/chat/completions", json={"messages": [], "standin": {"bogus": 1}})
    assert rejected.status_code == 400


def test_fault_status_and_times_then_reset(standin, client):
    url, _ = standin
    assert client.post(f"{url}/_standin/faults", json={"status": 503, "times": 1}).status_code == 200
    failed = client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES})
    assert failed.status_code == 503 and failed.json()["error"]["code"] == 503
    assert client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200
    assert client.post(f"{url}/_standin/faults", json={"nonsense": 1}).status_code == 400


def test_fault_health_status_and_tokenize_status(standin, client):
    url, _ = standin
    client.post(f"{url}/_standin/faults", json={"health_status": 503, "tokenize_status": 500})
    assert client.get(f"{url}/health").status_code == 503
    assert client.post(f"{url}/tokenize", json={"prompt": "a"}).status_code == 500
    client.post(f"{url}/_standin/faults", json={})
    assert client.get(f"{url}/health").status_code == 200
    assert client.get(f"{url}/_standin/faults").json() == {}


def test_die_after_chunks_drops_the_connection_mid_stream(standin, client):
    url, _ = standin
    client.post(f"{url}/_standin/faults", json={"die_after_chunks": 3})
    events = []
    with pytest.raises(httpx.RemoteProtocolError):
        with client.stream("POST", f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
    assert len(events) == 3
    assert stats(client, url)["died"] == 1
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES})


def test_stall_pauses_a_stream_past_a_read_timeout(standin, client):
    url, _ = standin
    client.post(f"{url}/_standin/faults", json={"stall_after_chunks": 2, "stall_s": 120})
    events = []
    with httpx.Client(timeout=httpx.Timeout(10.0, read=2.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            request = {"messages": MESSAGES, "stream": True}
            with impatient.stream("POST", f"{url}/v1/chat/completions", json=request) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
    assert len(events) == 2
    wait_for(lambda: stats(client, url)["aborted"] == 1)


def test_first_byte_delay_then_client_leaves_is_an_abort(standin, client):
    url, _ = standin
    client.post(f"{url}/_standin/faults", json={"first_byte_delay_s": 120})
    with raw_post(f"{url}/v1/chat/completions", {"messages": MESSAGES, "stream": True}):
        wait_for(lambda: stats(client, url)["running"] == 1)
    wait_for(lambda: stats(client, url)["aborted"] == 1)
    assert stats(client, url)["running"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_is_seen_and_counted(standin, client, stream):
    url, _ = standin
    request = {"messages": MESSAGES, "stream": stream, "standin": {"tokens": 10_000, "itl_ms": 5}}
    if stream:
        with httpx.Client(timeout=httpx.Timeout(10.0)) as leaving:
            with leaving.stream("POST", f"{url}/v1/chat/completions", json=request) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                wait_for(lambda: stats(client, url)["running"] == 1)
    else:  # the answer would take 50 s
        with raw_post(f"{url}/v1/chat/completions", request):
            wait_for(lambda: stats(client, url)["running"] == 1)
    wait_for(lambda: stats(client, url)["aborted"] == 1)
    seen = stats(client, url)
    assert seen["running"] == 0 and seen["finished"] == 0 and seen["started"] == 1


def test_hold_keeps_requests_in_flight_until_released(standin, client):
    url, _ = standin
    client.post(f"{url}/_standin/faults", json={"hold": True})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(
                httpx.post, f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stream": stream}, timeout=30
            )
            for stream in (False, True, False)
        ]
        wait_for(lambda: stats(client, url)["held"] == 3)
        seen = stats(client, url)
        assert seen["running"] == 3 and seen["finished"] == 0
        assert not any(future.done() for future in futures)  # no answer before the release
        assert client.post(f"{url}/_standin/release").json() == {"released": 3}
        answers = [future.result() for future in futures]
    assert [answer.status_code for answer in answers] == [200] * 3
    assert answers[1].text.endswith("data: [DONE]\n\n")
    seen = stats(client, url)
    assert seen["finished"] == 3 and seen["held"] == 0 and seen["running"] == 0
    assert client.get(f"{url}/_standin/faults").json() == {}  # the release ends the hold
    assert client.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200


def test_the_openai_sdk_reads_the_standin_like_an_engine(standin, request):
    import openai

    url, _ = standin
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    request.addfinalizer(client.close)
    assert [model.id for model in client.models.list().data] == ["m"]
    answer = client.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.usage.prompt_tokens == count_chat_tokens(MESSAGES)
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10_000)
