"""Metrics and request logs of the real gateway app, in front of the stand-in engine, driven by
the OpenAI SDK over real HTTP."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.observability.logs import ACCESS_LOGGER
from server.gateway.settings import GatewaySettings, HealthCheck, ModelEngines
from standin import StandinConfig, build_app
from tests.support import serve_in_thread, wait_for

TTFT_S = 0.2  # the stand-in sends the role chunk at once and the first token after this
STALL_S = 2.0  # and, on request, pauses this long after the first token: 10x TTFT_S, so a busy machine
# cannot make a first-token time taken at the first token look like one taken at the second


def gateway_samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def settled_samples(url: str, requests: int) -> dict[tuple[str, frozenset], float]:
    """The gateway's samples once `requests` requests are counted (each is, just after its response)."""

    def counted(samples: dict) -> float:
        return sum(value for (name, _), value in samples.items() if name == "gateway_requests_total")

    last: dict = {}

    def poll() -> dict | None:
        last["samples"] = gateway_samples(url)
        return last["samples"] if counted(last["samples"]) >= requests else None

    return wait_for(poll, what=lambda: f"{counted(last['samples']):g} of {requests} requests counted")


@pytest.fixture
def standin_url():
    with serve_in_thread(build_app(StandinConfig(ttft_ms=TTFT_S * 1000, itl_ms=50, tokens=6))) as url:
        yield url


@pytest.fixture
def hanging_engine():
    """An 'engine' that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", sock
    finally:
        sock.close()


def make_gateway(*models: ModelEngines, interval: float = 0.1, **settings_fields) -> tuple:
    settings = GatewaySettings(models=list(models), metrics_scrape_interval=interval, **settings_fields)
    app = create_app(settings, plan_deployment(settings.models).served_models(), registry=CollectorRegistry())
    return app, app.state


def test_ttft_once_per_stream_at_first_content_chunk_and_counters_by_status(standin_url, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    app, _ = make_gateway(ModelEngines(name="standin", urls=[standin_url]))
    with serve_in_thread(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": "hello"}]
        streamed = 2
        for _ in range(streamed):
            stream = client.chat.completions.create(
                model="standin",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"standin": {"stall_after_chunks": 2, "stall_s": STALL_S}},
            )
            chunks = list(stream)
            assert chunks[0].choices[0].delta.role == "assistant"
        plain = client.chat.completions.create(model="standin", messages=messages)
        assert plain.usage.completion_tokens == 6
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="standin", messages=messages, extra_body={"standin": {"status": 400}})
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=messages)
        got = settled_samples(url, 5)

    # Exactly one first-token observation per streamed request, none for the others...
    assert get(got, "gateway_time_to_first_token_seconds_count", model="standin") == streamed
    # ...taken at the first content chunk: not at the role chunk sent at once (it is later than
    # the stand-in's first-token delay), not at the second token (that comes STALL_S later).
    ttft_sum = get(got, "gateway_time_to_first_token_seconds_sum", model="standin")
    assert streamed * TTFT_S <= ttft_sum < streamed * (TTFT_S + STALL_S)
    assert get(got, "gateway_time_to_first_token_seconds_bucket", model="standin", le="0.15") == 0
    assert get(got, "gateway_time_to_first_token_seconds_bucket", model="standin", le="2.0") == 2
    # Five gaps between six tokens, per stream; the stall is one of them. The gateway observes a gap
    # per chunk it reads, so tokens a busy machine delivers in one read make one gap (seen: 5 of 10
    # with two CPU hogs running): the stall's gap is always there, the others may merge.
    assert streamed <= get(got, "gateway_inter_token_latency_seconds_count", model="standin") <= streamed * 5
    assert get(got, "gateway_inter_token_latency_seconds_sum", model="standin") >= streamed * STALL_S
    # Durations kept apart by stream kind.
    assert get(got, "gateway_request_duration_seconds_count", model="standin", stream="true") == 2
    assert get(got, "gateway_request_duration_seconds_count", model="standin", stream="false") == 2
    # Counters by the status the client saw.
    assert get(got, "gateway_requests_total", model="standin", code="200") == 3
    assert get(got, "gateway_requests_total", model="standin", code=str(failed.value.status_code)) == 1
    assert get(got, "gateway_requests_total", model="_unknown", code="404") == 1
    assert not any(dict(labels).get("model") == "nope" for _, labels in got)
    assert get(got, "gateway_requests_in_flight", model="standin") == 0
    assert get(got, "gateway_completion_tokens_total", model="standin") == 3 * 6
    assert get(got, "gateway_prompt_tokens_total", model="standin") > 0
    assert get(got, "gateway_engine_up", model="standin", engine=standin_url.split("//")[1]) == 1

    # One access log line per request, agreeing with the metrics.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [line["status"] for line in lines] == [200] * 3 + [failed.value.status_code, 404]
    assert [line["stream"] for line in lines[:3]] == [True] * 2 + [False]
    assert all(TTFT_S <= line["ttft_s"] < TTFT_S + STALL_S for line in lines[:2])
    assert lines[2]["ttft_s"] is None
    assert all(line["request_id"] for line in lines)
    assert "hello" not in json.dumps(lines)


def test_access_log_off_writes_no_request_lines_and_still_counts_every_request(standin_url, caplog):
    """`access_log: false`: no line on `gateway.access`, the same metrics, and a failure's warning stays."""
    caplog.set_level(logging.INFO)
    app, _ = make_gateway(ModelEngines(name="standin", urls=[standin_url]), access_log=False)
    with serve_in_thread(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": "hello"}]
        stream = client.chat.completions.create(model="standin", messages=messages, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert client.chat.completions.create(model="standin", messages=messages).usage.completion_tokens == 6
        with pytest.raises(openai.APIError):  # the engine dies mid-stream: the gateway warns
            list(
                client.chat.completions.create(
                    model="standin", messages=messages, stream=True, extra_body={"standin": {"die_after_chunks": 2}}
                )
            )
        got = settled_samples(url, 3)
    assert get(got, "gateway_requests_total", model="standin", code="200") == 3
    assert get(got, "gateway_completion_tokens_total", model="standin") >= 2 * 6
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert any(r.levelno == logging.WARNING and "failed mid-stream" in r.getMessage() for r in caplog.records)


def test_dead_engines_are_marked_down_without_slowing_requests(standin_url, hanging_engine):
    """One engine hangs (accepts, never answers), one refuses. While the gateway's scrape of the
    hanging engine is provably outstanding (we hold its connection unanswered), requests and the
    gateway's own /metrics are served, and both dead engines show as down."""
    hanging_url, hang = hanging_engine
    refused_sock = socket.socket()
    refused_sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    refused_url = f"http://127.0.0.1:{refused_sock.getsockname()[1]}"
    held: list[socket.socket] = []
    try:
        app, _ = make_gateway(
            ModelEngines(name="standin", urls=[standin_url]),
            ModelEngines(name="ghost", urls=[hanging_url, refused_url]),
            health=HealthCheck(timeout=0.5),  # the gateway's start-up health round waits this long
        )
        with serve_in_thread(app) as url:
            hang.settimeout(10)
            while True:  # health checks connect too; wait for the scrape of /metrics
                conn, _ = hang.accept()
                held.append(conn)
                if conn.recv(4096).startswith(b"GET /metrics"):
                    break
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                for _ in range(3):
                    stream = client.chat.completions.create(
                        model="standin", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 6
            got = settled_samples(url, 3)
            hanging, refused = (u.split("//")[1] for u in (hanging_url, refused_url))
            assert get(got, "gateway_engine_up", model="ghost", engine=refused) == 0
            assert get(got, "gateway_engine_up", model="ghost", engine=hanging) == 0
            assert get(got, "gateway_engine_up", model="standin", engine=standin_url[7:]) == 1
            assert get(got, "gateway_requests_total", model="standin", code="200") == 3
    finally:
        for conn in held:
            conn.close()
        refused_sock.close()


def test_a_running_gateway_exports_how_late_its_event_loop_runs(standin_url):
    """The loop watch starts with the app: its lateness, one observation every 0.1 s, is on /metrics."""
    app, _ = make_gateway(ModelEngines(name="standin", urls=[standin_url]))
    with serve_in_thread(app) as url:

        def observed() -> dict | None:
            samples = gateway_samples(url)
            return samples if get(samples, "gateway_event_loop_lag_seconds_count") >= 3 else None

        got = wait_for(observed, what="three observations of the event loop's lag")
    assert get(got, "gateway_event_loop_lag_seconds_bucket", le="+Inf") == get(
        got, "gateway_event_loop_lag_seconds_count"
    )
    assert get(got, "gateway_event_loop_lag_seconds_sum") >= 0
