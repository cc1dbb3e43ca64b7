"""Token counters for every stream: the engine is asked for usage the client did not ask for, and the
client's stream stays what it would have been (proxy.hidden_usage)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server.gateway.proxy.hidden_usage import HiddenUsage, hide_usage_from_client, stamp
from server.gateway.request.endpoints import BY_PATH
from server.gateway.request.request import parse_request
from tests.gateway.conftest import chat_body, fast_settings
from tests.support import WAIT_TIMEOUT, wait_for

FP = b'"vllm-0.32.0-2189bed6"'
# What vLLM 0.32 sends for one stream (seen on the real engine), without and with include_usage.
ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Lis"},"finish_reason":null}]}\n\n'
LAST = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length","stop_reason":null}]}\n\n'
LAST_STAMPED = LAST[:-3] + b',"system_fingerprint":' + FP + b"}\n\n"
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":14,"total_tokens":17,"completion_tokens":3},'
    b'"system_fingerprint":' + FP + b"}\n\n"
)
DONE = b"data: [DONE]\n\n"
WITHOUT = ROLE + TOKEN + LAST_STAMPED + DONE
WITH = ROLE + TOKEN + LAST + USAGE + DONE


def relay(reads: list[bytes], fingerprints: dict[str, bytes] | None = None) -> tuple[list[bytes], dict | None]:
    hidden = HiddenUsage({} if fingerprints is None else fingerprints, "e0")
    sent = [hidden.feed(read) for read in reads]
    usage = hidden.finish()
    return [*sent, hidden.rest], usage


def splits(data: bytes) -> list[list[bytes]]:
    """`data` cut into reads every way a network might: whole, per event, per byte-run of several sizes."""
    events = [e + b"\n\n" for e in data.split(b"\n\n")[:-1]]
    cuts = [[data], events]
    for size in (1, 7, 64, 200):
        cuts.append([data[i : i + size] for i in range(0, len(data), size)])
    return cuts


@pytest.mark.parametrize("reads", splits(WITH), ids=["whole", "events", "1", "7", "64", "200"])
def test_the_client_gets_exactly_the_stream_it_did_not_ask_usage_for(reads):
    sent, usage = relay(reads)
    assert b"".join(sent) == WITHOUT
    assert usage == {"prompt_tokens": 14, "total_tokens": 17, "completion_tokens": 3}


def test_only_the_chunk_that_finishes_a_choice_waits_for_the_next_read():
    sent, _ = relay([ROLE, TOKEN, LAST, USAGE + DONE])
    assert sent == [ROLE, TOKEN, b"", LAST_STAMPED + DONE, b""]


def test_an_engine_without_fingerprint_gets_nothing_stamped():
    usage = USAGE.replace(b',"system_fingerprint":' + FP, b"")
    sent, found = relay([ROLE + TOKEN + LAST, usage, DONE])
    assert b"".join(sent) == ROLE + TOKEN + LAST + DONE
    assert found is not None and found["completion_tokens"] == 3


def test_a_choice_finishing_before_the_others_gets_the_engines_last_fingerprint_without_waiting():
    other = TOKEN.replace(b'"index":0', b'"index":1')
    sent, _ = relay([LAST, other, other], fingerprints={"e0": FP})
    assert sent[:3] == [b"", LAST_STAMPED + other, other]


def test_a_stream_cut_short_hands_back_what_was_held():
    hidden = HiddenUsage({"e0": FP}, "e0")
    assert hidden.feed(TOKEN + LAST) == TOKEN
    assert hidden.take() == LAST_STAMPED


def test_stamp_leaves_unfinished_and_already_stamped_chunks_alone():
    assert stamp(TOKEN + LAST_STAMPED, FP) == TOKEN + LAST_STAMPED
    assert stamp(TOKEN + LAST, None) == TOKEN + LAST


def _request(body: dict, path: str = "/v1/chat/completions"):
    return parse_request(json.dumps(body).encode(), BY_PATH[path])


@pytest.mark.parametrize(
    ("options", "hidden", "sent"),
    [
        (None, True, {"include_usage": True}),
        ("null", True, {"include_usage": True, "continuous_usage_stats": False}),
        ({"include_usage": False}, True, {"include_usage": True, "continuous_usage_stats": False}),
        ({"continuous_usage_stats": True}, True, {"include_usage": True, "continuous_usage_stats": False}),
        ({"include_usage": True}, False, {"include_usage": True}),
        ({"include_usage": True, "continuous_usage_stats": True}, False, None),
    ],
)
def test_the_engine_is_asked_for_usage_unless_the_client_asked(options, hidden, sent):
    body = chat_body(stream=True)
    if options is not None:
        body["stream_options"] = None if options == "null" else options
    request = _request(body)
    assert hide_usage_from_client(request) is hidden
    upstream = json.loads(request.raw)
    assert request.raw.count(b'"stream_options"') == 1
    assert upstream["stream_options"] == (sent if sent is not None else options)
    assert {k: v for k, v in upstream.items() if k != "stream_options"} == {
        k: v for k, v in body.items() if k != "stream_options"
    }


def test_requests_without_a_stream_or_without_the_option_are_sent_as_they_came():
    for request in (
        _request(chat_body()),
        parse_request(b'{"model": "m", "input": "hi", "stream": true}', BY_PATH["/v1/responses"]),
    ):
        raw = request.raw
        assert hide_usage_from_client(request) is False and request.raw is raw
    completions = _request({"model": "m", "prompt": "hi", "stream": True}, "/v1/completions")
    assert hide_usage_from_client(completions) and b'"include_usage":true' in completions.raw


# -- through a gateway, against the stand-in engine ------------------------------------------------


def _normalised(body: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', body)


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=WAIT_TIMEOUT).text
    out = {}
    for line in text.splitlines():
        for name in ("prompt_tokens", "completion_tokens"):
            if line.startswith(f'gateway_{name}_total{{model="standin"}}'):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body("one two three", stream=True)),
        ("/v1/chat/completions", chat_body("one two", stream=True, stream_options={"continuous_usage_stats": True})),
        ("/v1/completions", {"model": "standin", "prompt": "one two three four", "stream": True, "max_tokens": 5}),
    ],
    ids=["chat", "chat-continuous-only", "completions"],
)
def test_through_the_gateway_the_stream_is_byte_for_byte_the_engines_and_its_usage_is_counted(
    engines, gateway, path, body
):
    (engine,) = engines(1, tokens=7)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    headers = {"x-request-id": "same-id"}  # the stand-in names its chunks after it
    direct = httpx.post(f"{engine.url}{path}", json=body, headers=headers, timeout=WAIT_TIMEOUT)
    through = httpx.post(f"{gw.url}{path}", json=body, headers=headers, timeout=WAIT_TIMEOUT)
    assert through.status_code == direct.status_code == 200
    assert b'"usage"' not in through.content and b'"system_fingerprint"' in through.content
    assert _normalised(through.content) == _normalised(direct.content)
    assert engine.stats()["last_request"]["body"]["stream_options"]["include_usage"] is True
    asked = dict(body, stream_options={"include_usage": True})
    usage = json.loads(
        [line for line in httpx.post(f"{engine.url}{path}", json=asked).text.split("\n\n") if '"usage"' in line][0][6:]
    )["usage"]
    wait_for(
        lambda: (
            _counters(gw.url)
            == {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}
        )
    )


def test_a_client_that_asked_for_usage_gets_it_as_the_engine_sent_it(engines, gateway):
    (engine,) = engines(1)
    gw = gateway(fast_settings({"standin": [engine.url]}))
    body = chat_body(stream=True, stream_options={"include_usage": True})
    headers = {"x-request-id": "asked"}
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=headers, timeout=WAIT_TIMEOUT)
    through = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=WAIT_TIMEOUT)
    assert b'"usage"' in through.content
    assert _normalised(through.content) == _normalised(direct.content)
