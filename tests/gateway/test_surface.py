"""The endpoints beyond chat through the gateway, in front of stand-in engines over real sockets:
Responses state and streaming, uploads, endpoints an engine does not serve, LoRA, metrics."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from standin.surface import SurfaceStandin
from tests.gateway.conftest import fast_settings
from tests.support import serve_in_thread, wait_for


@pytest.fixture
def standins() -> Iterator[Callable[..., list[tuple[str, SurfaceStandin]]]]:
    """start(n, **SurfaceStandin fields) -> n running stand-ins as (url, app)."""
    with contextlib.ExitStack() as stack:

        def start(n: int = 1, **config: Any) -> list[tuple[str, SurfaceStandin]]:
            apps = [SurfaceStandin(**config) for _ in range(n)]
            return [(stack.enter_context(serve_in_thread(app)), app) for app in apps]

        yield start


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


# -- Responses: the gateway keeps them (app.responses); engines get stateless requests ------------


def test_continuations_are_sent_whole_and_stateless_and_stored_state_never_reaches_an_engine(standins, gateway):
    (a_url, a), (b_url, b) = standins(2)
    gw = gateway(fast_settings({"standin": [a_url, b_url]}))
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        first = client.post("/v1/responses", json={"model": "standin", "input": "hi", "request_id": "mine"})
        assert first.status_code == 200, first.text
        previous = first.json()["id"]
        assert previous != "mine" and previous.startswith("resp_")  # the gateway chose it
        for turn in range(6):
            follow = client.post(
                "/v1/responses", json={"model": "standin", "input": f"and {turn}?", "previous_response_id": previous}
            )
            assert follow.status_code == 200, follow.text
            assert follow.json()["previous_response_id"] == previous
            previous = follow.json()["id"]
        retrieved = client.get(f"/v1/responses/{previous}")
        assert retrieved.status_code == 200 and retrieved.json() == follow.json()
        items = client.get(f"/v1/responses/{previous}/input_items").json()
        assert [item["content"][0]["text"] for item in items["data"]] == ["and 5?"]
        assert client.delete(f"/v1/responses/{previous}").json() == {
            "id": previous,
            "object": "response.deleted",
            "deleted": True,
        }
        assert client.get(f"/v1/responses/{previous}").status_code == 404
    sent = [json.loads(r.body) for engine in (a, b) for r in engine.requests if r.path == "/v1/responses"]
    assert len(sent) == 7
    assert all(body["store"] is False and "previous_response_id" not in body for body in sent)
    longest = max(len(body["input"]) if isinstance(body["input"], list) else 1 for body in sent)
    assert longest == 6 * 2 + 1  # the six turns before (input, output), then the new input
    assert not [r for engine in (a, b) for r in engine.requests if r.method != "POST"]


def test_unknown_response_ids_are_404_in_the_envelope(standins, gateway):
    ((url, engine),) = standins(1)
    gw = gateway(fast_settings({"standin": [url]}))
    foreign = "resp_0123456789abcdef"  # made by an engine directly, or by another deployment
    for method, path, param in (
        ("GET", f"/v1/responses/{foreign}", "response_id"),
        ("DELETE", f"/v1/responses/{foreign}", "response_id"),
        ("GET", f"/v1/responses/{foreign}/input_items", "response_id"),
        ("POST", f"/v1/responses/{foreign}/cancel", "response_id"),
    ):
        answer = httpx.request(method, f"{gw.url}{path}", timeout=10)
        assert answer.status_code == 404, (method, path)
        assert answer.json()["error"]["code"] == "response_not_found"
        assert answer.json()["error"]["param"] == param
    follow = httpx.post(
        f"{gw.url}/v1/responses",
        json={"model": "standin", "input": "x", "previous_response_id": foreign},
        timeout=10,
    )
    assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
    assert not engine.requests  # nothing reached the engine


def test_streamed_responses_measure_ttft_and_usage(standins, gateway):
    ((url, _),) = standins(1, event_delay_s=0.05)
    gw = gateway(fast_settings({"standin": [url]}))
    with httpx.stream(
        "POST", f"{gw.url}/v1/responses", json={"model": "standin", "input": "hi", "stream": True}, timeout=10
    ) as answer:
        text = answer.read().decode()
    assert [e["type"] for e in events(text)][-1] == "response.completed"
    wait_for(lambda: gw.metric("gateway_endpoint_requests_total", code="200", endpoint="responses") == 1)
    assert gw.metric("gateway_endpoint_time_to_first_token_seconds_count", endpoint="responses") == 1
    assert gw.metric("gateway_time_to_first_token_seconds_count", model="standin") == 1
    # 3 deltas, 2 gaps (fewer if a loaded machine delivers two deltas in one read)
    assert 1 <= gw.metric("gateway_inter_token_latency_seconds_count", model="standin") <= 2
    assert gw.metric("gateway_prompt_tokens_total", model="standin") == 7  # from response.completed
    assert gw.metric("gateway_completion_tokens_total", model="standin") == 3


def test_an_engine_dying_mid_stream_ends_a_responses_stream_with_an_error_event(standins, gateway):
    ((url, _),) = standins(1, die_after_events=3)
    gw = gateway(fast_settings({"standin": [url]}))
    with httpx.stream(
        "POST", f"{gw.url}/v1/responses", json={"model": "standin", "input": "hi", "stream": True}, timeout=10
    ) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
    got = events(text)
    assert [e["type"] for e in got] == [
        "response.created",
        "response.output_text.delta",
        "response.output_text.delta",
        "error",
    ]
    assert got[-1]["code"] == "upstream_failed" and got[-1]["sequence_number"] == 3
    assert text.endswith("\n\n") and "[DONE]" not in text  # Responses streams have no [DONE]
    assert "event: error\n" in text
    # The cut answer is recorded `incomplete`, never half-written as if it had completed.
    stored = httpx.get(f"{gw.url}/v1/responses/{got[0]['response']['id']}", timeout=10)
    assert stored.status_code == 200 and stored.json()["status"] == "incomplete"
    assert stored.json()["output"] == []


# -- other endpoints ------------------------------------------------------------------------------


def test_embeddings_go_to_the_model_named_and_are_counted_by_endpoint(standins, gateway):
    ((chat_url, chat), (embed_url, embed)) = standins(1, model="chat") + standins(1, model="embed")
    gw = gateway(fast_settings({"chat": [chat_url], "embed": [embed_url]}))
    answer = httpx.post(f"{gw.url}/v1/embeddings", json={"model": "embed", "input": ["a", "b"]}, timeout=10)
    assert answer.status_code == 200 and len(answer.json()["data"]) == 2
    assert [r.path for r in embed.requests] == ["/v1/embeddings"] and not chat.requests
    wait_for(lambda: gw.metric("gateway_endpoint_requests_total", code="200", endpoint="embeddings") == 1)
    assert gw.metric("gateway_prompt_tokens_total", model="embed") == 4


def test_an_endpoint_the_engine_does_not_serve_is_its_404_in_the_envelope(standins, gateway):
    ((url, _),) = standins(1)
    gw = gateway(fast_settings({"standin": [url]}))
    answer = httpx.post(f"{gw.url}/v1/rerank", json={"model": "standin", "query": "q", "documents": ["d"]})
    assert answer.status_code == 404
    assert answer.json() == {
        "error": {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": "not_found"}
    }


def test_uploads_are_routed_by_their_form_field_and_forwarded_untouched(standins, gateway):
    ((a_url, a), (b_url, b)) = standins(1, model="a") + standins(1, model="b")
    gw = gateway(fast_settings({"a": [a_url], "b": [b_url]}, limits={"max_upload_bytes": 64 * 1024}))
    files = {"file": ("clip.wav", b"RIFF" + bytes(2000), "audio/wav")}
    answer = httpx.post(
        f"{gw.url}/v1/audio/transcriptions", data={"model": "b", "language": "en"}, files=files, timeout=10
    )
    assert answer.status_code == 200, answer.text
    (seen,) = b.requests
    assert not a.requests
    assert seen.content_type.startswith("multipart/form-data; boundary=")
    assert b"RIFF" in seen.body and b'name="language"' in seen.body
    big = {"file": ("big.wav", bytes(70 * 1024), "audio/wav")}
    too_big = httpx.post(f"{gw.url}/v1/audio/transcriptions", data={"model": "b"}, files=big, timeout=10)
    assert too_big.status_code == 413
    no_model = httpx.post(f"{gw.url}/v1/audio/transcriptions", files=files, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    not_a_form = httpx.post(f"{gw.url}/v1/audio/transcriptions", json={"model": "b"}, timeout=10)
    assert not_a_form.status_code == 400 and not_a_form.json()["error"]["code"] == "invalid_content_type"


def test_wrong_methods_on_known_paths_are_405(standins, gateway):
    ((url, _),) = standins(1)
    gw = gateway(fast_settings({"standin": [url]}))
    assert httpx.get(f"{gw.url}/v1/embeddings").status_code == 405
    assert httpx.put(f"{gw.url}/v1/responses/resp_x").status_code == 405  # DELETE is served (app.responses)
    assert httpx.get(f"{gw.url}/v1/nothing").status_code == 404


# -- LoRA adapters --------------------------------------------------------------------------------


def test_adapter_requests_go_only_to_replicas_that_serve_them(standins, gateway):
    (with_url, with_lora), (without_url, without_lora) = standins(1, adapters={"travel": "/a"}) + standins(1)
    gw = gateway(fast_settings({"standin": [with_url, without_url]}))
    listed = httpx.get(f"{gw.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("standin", None), ("travel", "standin")]
    assert httpx.get(f"{gw.url}/v1/models/travel").json()["parent"] == "standin"
    body = {"model": "travel", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(4):
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    assert len(with_lora.requests) == 4 and not without_lora.requests
    unknown = httpx.post(f"{gw.url}/v1/chat/completions", json=dict(body, model="nope"), timeout=10)
    assert unknown.status_code == 404 and "travel" in unknown.json()["error"]["message"]


def test_runtime_load_and_unload_reach_every_replica_behind_the_admin_key(standins, gateway):
    (a_url, a), (b_url, b) = standins(2)
    # The worker that takes the load routes the adapter at once; the others (and other gateway
    # replicas) see it when they next read the engines' /v1/models (health.models_interval).
    settings = fast_settings({"standin": [a_url, b_url]}, health={"models_interval": 0.1})
    gw = gateway(settings, environ={"GATEWAY_ADMIN_KEYS": "admin-key"})
    load = {"model": "standin", "lora_name": "travel", "lora_path": "/loras/travel"}
    url = f"{gw.url}/v1/load_lora_adapter"
    assert httpx.post(url, json=load).status_code == 401
    assert httpx.post(url, json=load, headers={"authorization": "Bearer wrong"}).status_code == 401
    admin = {"authorization": "Bearer admin-key"}
    answer = httpx.post(url, json=load, headers=admin, timeout=10)
    assert answer.status_code == 200, answer.text
    assert [e["status"] for e in answer.json()["engines"]] == [200, 200]
    assert a.adapters == b.adapters == {"travel": "/loras/travel"}
    wait_for(lambda: all("travel" in listed(r) for r in gw.each_worker("GET", "/v1/models").values()))
    travel = {"model": "travel", "messages": [{"role": "user", "content": "hi"}]}
    assert all(r.status_code == 200 for r in gw.each_worker("POST", "/v1/chat/completions", json=travel).values())
    again = httpx.post(url, json=load, headers=admin, timeout=10)  # the engines refuse a second load
    assert again.status_code == 400 and again.json()["error"]["code"] == "fan_out_failed"
    unload = httpx.post(
        f"{gw.url}/v1/unload_lora_adapter", json={"model": "standin", "lora_name": "travel"}, headers=admin, timeout=10
    )
    assert unload.status_code == 200 and a.adapters == b.adapters == {}
    wait_for(lambda: all("travel" not in listed(r) for r in gw.each_worker("GET", "/v1/models").values()))


def test_an_adapter_loaded_on_the_engine_itself_is_routed_after_the_next_models_read(standins, gateway):
    ((url, engine),) = standins(1)
    gw = gateway(fast_settings({"standin": [url]}, health={"models_interval": 0.1}))
    assert [m["id"] for m in httpx.get(f"{gw.url}/v1/models").json()["data"]] == ["standin"]
    engine.adapters["travel"] = "/loras/travel"  # as an operator's direct call to the engine would
    wait_for(lambda: all("travel" in listed(r) for r in gw.each_worker("GET", "/v1/models").values()))
    body = {"model": "travel", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10).status_code == 200
    del engine.adapters["travel"]
    wait_for(lambda: all("travel" not in listed(r) for r in gw.each_worker("GET", "/v1/models").values()))
    gone = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def listed(models: httpx.Response) -> list[str]:
    return [m["id"] for m in models.json()["data"]]


def test_without_admin_keys_runtime_lora_is_refused(standins, gateway):
    ((url, engine),) = standins(1)
    gw = gateway(fast_settings({"standin": [url]}), environ={})
    answer = httpx.post(
        f"{gw.url}/v1/load_lora_adapter", json={"model": "standin", "lora_name": "x", "lora_path": "/x"}
    )
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "permission_denied"
    assert not engine.requests
