"""The HistoryTrimming step in front of the stand-in engine, over real HTTP.

`StepRouter` (tests/gateway/trimming/harness.py) plays the router's part: it parses the body
once, calls the step and forwards the request's bytes and response headers. The stand-in counts
tokens deterministically (4 per message + its words, 3 for the generation prompt) through
/tokenize and in `usage.prompt_tokens`, so every number here can be predicted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from server.config import TrimmingConfig
from server.gateway.observability.metrics import GatewayMetrics
from server.gateway.request.endpoints import BY_NAME
from server.gateway.request.request import parse_request
from server.gateway.trimming.decision import effective_mode
from server.gateway.trimming.step import HistoryTrimming
from standin import StandinConfig, build_app, count_chat_tokens
from tests.gateway.trimming.harness import StepRouter
from tests.support import serve_in_thread, wait_for

MODEL = "standin"
# httpx builds an SSL context per client (25 ms) unless given one; the tests make many clients.
_TLS = ssl.create_default_context()


@dataclass
class StandinTarget:
    """A TrimTarget whose tokenizer is the stand-in's /tokenize; records each call's list length."""

    trimming: TrimmingConfig
    max_model_len: int | None = 1000
    url: str = ""
    calls: list[int] = field(default_factory=list)

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool) -> int:
        self.calls.append(len(messages))
        async with httpx.AsyncClient(base_url=self.url, timeout=5.0, verify=_TLS) as client:
            response = await client.post(
                "/tokenize",
                json={
                    "model": MODEL,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                },
            )
            response.raise_for_status()
            return response.json()["count"]


@dataclass
class Stack:
    url: str
    engine: object
    target: StandinTarget
    metrics: GatewayMetrics
    step: HistoryTrimming

    def chat(self, messages: list[dict], headers: dict | None = None, **extra) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            headers=headers or {},
            timeout=10.0,
            json={"model": MODEL, "messages": messages, **extra},
            verify=_TLS,
        )

    def received(self) -> list[dict]:
        return self.engine.last_request["body"]["messages"]

    def trimmed_total(self, what: str) -> float:
        value = self.metrics.registry.get_sample_value(f"gateway_trimmed_{what}_total", {"model": MODEL})
        return value or 0.0


@contextlib.contextmanager
def stack(mode: str = "auto", *, max_model_len: int | None = 1000, **trimming) -> Iterator[Stack]:
    engine = build_app(StandinConfig(model=MODEL, max_model_len=1000, ttft_ms=1, itl_ms=1, tokens=4))
    target = StandinTarget(TrimmingConfig(mode=mode, **trimming), max_model_len=max_model_len)
    metrics = GatewayMetrics()

    async def lookup(model: str) -> StandinTarget | None:
        return target if model == MODEL else None

    step = HistoryTrimming(lookup=lookup, metrics=metrics)
    with serve_in_thread(StepRouter(step, engine)) as url:
        target.url = url
        yield Stack(url, engine, target, metrics, step)


def conversation(turns: int, words: int = 20) -> list[dict]:
    """A 30-word system prompt, then alternating user/assistant turns of `words` words each."""
    messages = [{"role": "system", "content": "rule " * 30}]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn{i} " + "w " * (words - 1)})
    return messages


def test_a_long_history_is_trimmed_to_the_budget():
    with stack("window") as s:
        messages = conversation(61)  # 34 + 61 * 24 + 3 = 1501 tokens, budget 1000 - 100
        assert count_chat_tokens(messages) == 1501
        response = s.chat(messages, max_tokens=100)
        assert response.status_code == 200, response.text
        kept = s.received()
        assert kept[0] == messages[0] and kept[-1] == messages[-1]
        assert kept[1:] == messages[len(messages) - len(kept) + 1 :]
        assert kept[1]["role"] == "user"
        prompt = response.json()["usage"]["prompt_tokens"]
        assert prompt == count_chat_tokens(kept) <= 900
        assert prompt > 900 - 2 * 24  # the longest suffix: one more user+assistant pair would not fit
        assert response.headers["x-trim-status"] == "trimmed"
        assert int(response.headers["x-trimmed-messages"]) == len(messages) - len(kept)
        assert int(response.headers["x-trimmed-tokens"]) == 1501 - prompt
        assert int(response.headers["x-prompt-tokens-estimate"]) == prompt
        assert s.trimmed_total("messages") == len(messages) - len(kept)
        assert s.trimmed_total("tokens") == 1501 - prompt


def test_auto_cuts_down_to_the_low_mark_and_then_the_prompt_only_grows():
    """Watermarks: the engine sees each prompt extend the previous one, except at a few cuts,
    each of which leaves at most the low mark (0.65 of the 900-token budget)."""
    with stack() as s:
        messages = conversation(1)
        received, prompts = [], []
        for turn in range(30):
            response = s.chat(messages, max_tokens=100)
            assert response.status_code == 200, response.text
            received.append(s.received())
            prompts.append(response.json()["usage"]["prompt_tokens"])
            assert prompts[-1] <= 900
            messages = [
                *messages,
                {"role": "assistant", "content": f"reply{turn} " + "w " * 19},
                {"role": "user", "content": f"next{turn} " + "w " * 19},
            ]
        cuts = [t for t in range(1, 30) if received[t][: len(received[t - 1])] != received[t - 1]]
        assert cuts and cuts[0] == 18  # 34 + 24 * (2t + 1) + 3 tokens pass 900 at turn 18
        for t in range(1, 30):
            assert received[t][0] == messages[0] and received[t][-1] == messages[2 * t + 1]
            if t in cuts:
                assert prompts[t] <= 900 * 0.65 and received[t][1]["role"] == "user"
            else:
                assert received[t] == [*received[t - 1], *messages[2 * t : 2 * t + 2]]
        assert len(cuts) < 29 - cuts[0]  # the window would have moved on every turn since


def test_a_history_far_under_budget_is_sent_before_its_new_message_is_counted():
    with stack() as s:
        messages = conversation(3)
        assert s.chat(messages, max_tokens=5).headers["x-prompt-tokens-estimate"]  # calibrates
        calls = len(s.target.calls)
        messages.append({"role": "user", "content": "and one more thing"})
        response = s.chat(messages, max_tokens=5)
        assert response.headers["x-trim-status"] == "kept"
        assert "x-prompt-tokens-estimate" not in response.headers  # not counted before sending
        _wait_for_background_counts(s.step)
        assert s.target.calls[calls:] == [1]  # counted afterwards, alone
        again = s.chat(messages, max_tokens=5)
        assert int(again.headers["x-prompt-tokens-estimate"]) == again.json()["usage"]["prompt_tokens"]
        assert s.target.calls[calls:] == [1]


def test_a_history_that_fits_passes_byte_for_byte():
    with stack() as s:
        raw = json.dumps({"model": MODEL, "messages": conversation(3), "max_tokens": 5}, indent=2)
        response = httpx.post(f"{s.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 200
        assert response.headers["x-trim-status"] == "kept"
        assert response.headers["x-trimmed-messages"] == "0"
        assert response.headers["x-trimmed-tokens"] == "0"
        assert int(response.headers["x-prompt-tokens-estimate"]) == response.json()["usage"]["prompt_tokens"]
        assert s.engine.last_request["body"] == json.loads(raw)
        assert s.trimmed_total("messages") == 0


def test_the_answer_reservation_comes_from_the_request_or_the_profile():
    messages = conversation(31)  # 34 + 31 * 24 + 3 = 781 tokens
    with stack(default_max_tokens=300) as s:
        assert s.chat(messages).headers["x-trim-status"] == "trimmed"  # budget 700
        assert count_chat_tokens(s.received()) <= 700
        assert s.chat(messages, max_tokens=200).headers["x-trim-status"] == "kept"  # budget 800
        # max_completion_tokens wins over max_tokens.
        response = s.chat(messages, max_tokens=200, max_completion_tokens=500)
        assert response.headers["x-trim-status"] == "trimmed"
        assert response.json()["usage"]["prompt_tokens"] <= 500


def test_a_smaller_history_budget_wins():
    with stack(history_budget_tokens=200) as s:
        response = s.chat(conversation(31), max_tokens=10)
        assert response.headers["x-trim-status"] == "trimmed"
        assert response.json()["usage"]["prompt_tokens"] <= 200


def _assert_context_error(response: httpx.Response, *numbers: int) -> None:
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    for number in numbers:
        assert str(number) in error["message"]


def test_strict_mode_refuses_instead_of_trimming():
    with stack("strict") as s:
        before = s.engine.stats()["started"]
        response = s.chat(conversation(61), max_tokens=100)
        _assert_context_error(response, 1501, 900)
        assert response.headers["x-trim-status"] == "rejected"
        assert s.engine.stats()["started"] == before
        assert s.chat(conversation(3), max_tokens=100).status_code == 200


def test_the_header_can_ask_for_a_stricter_mode_but_never_a_looser_one():
    long = conversation(61)
    with stack("auto") as s:
        _assert_context_error(s.chat(long, {"x-trim-mode": "strict"}, max_tokens=100), 1501, 900)
        loosened = s.chat(long, {"x-trim-mode": "off"}, max_tokens=100)
        assert loosened.status_code == 200 and loosened.headers["x-trim-status"] == "trimmed"
    with stack("strict") as s:
        _assert_context_error(s.chat(long, {"x-trim-mode": "auto"}, max_tokens=100), 1501, 900)
        _assert_context_error(s.chat(long, {"x-trim-mode": "off"}, max_tokens=100), 1501, 900)
    with stack("off") as s:
        _assert_context_error(s.chat(long, {"X-Trim-Mode": "Strict"}, max_tokens=100), 1501, 900)
        assert s.chat(long, {"x-trim-mode": "auto"}, max_tokens=100).headers["x-trim-status"] == "trimmed"
        bad = s.chat(long, {"x-trim-mode": "loose"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_trim_mode"


def test_mode_order():
    assert effective_mode("off", None) == "off"
    assert effective_mode("off", "auto") == "auto"
    assert effective_mode("auto", "off") == "auto"
    assert effective_mode("strict", "auto") == "strict"


def test_off_passes_everything_and_the_engine_refuses_what_does_not_fit():
    with stack("off") as s:
        response = s.chat(conversation(61), max_tokens=100)
        assert response.status_code == 400  # the stand-in's own context error
        assert "x-trim-status" not in response.headers
        assert s.target.calls == []


def test_refuses_with_both_numbers_when_system_plus_newest_do_not_fit():
    with stack() as s:
        messages = [
            {"role": "system", "content": "rule " * 500},
            {"role": "user", "content": "old"},
            {"role": "user", "content": "new " * 500},
        ]
        response = s.chat(messages, max_tokens=100)
        _assert_context_error(response, 504 + 504 + 3, 900)
        assert s.engine.stats()["started"] == 0


def test_tool_calls_and_results_are_kept_together():
    with stack(history_budget_tokens=110) as s:
        messages = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "old " * 60},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                    {"id": "b", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "sun " * 40},
            {"role": "tool", "tool_call_id": "b", "content": "rain " * 40},
        ]
        response = s.chat(messages, max_tokens=10)
        assert response.status_code == 200, response.text
        assert [m["role"] for m in s.received()] == ["system", "assistant", "tool", "tool"]
        assert response.json()["usage"]["prompt_tokens"] == count_chat_tokens(s.received()) == 106


def test_streaming_responses_carry_the_headers_and_stream_as_usual():
    with stack() as s:
        body = {
            "model": MODEL,
            "messages": conversation(61),
            "max_tokens": 100,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=10.0) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-trim-status"] == "trimmed"
            estimate = int(response.headers["x-prompt-tokens-estimate"])
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["prompt_tokens"] == estimate <= 900


def test_a_failing_tokenizer_passes_the_request_through_untrimmed_and_logs_once(caplog):
    with stack() as s:
        httpx.post(f"{s.url}/_standin/faults", json={"tokenize_status": 503})
        messages = conversation(5)
        with caplog.at_level(logging.WARNING, logger="gateway.trimming"):
            first = s.chat(messages, max_tokens=10)
            second = s.chat(messages, max_tokens=10)
        assert first.status_code == second.status_code == 200
        assert first.headers["x-trim-status"] == second.headers["x-trim-status"] == "unavailable"
        assert s.received() == messages
        assert len([r for r in caplog.records if r.name == "gateway.trimming"]) == 1
        httpx.post(f"{s.url}/_standin/faults", json={})
        assert s.chat(messages, max_tokens=10).headers["x-trim-status"] == "kept"


def test_a_growing_conversation_costs_one_small_tokenize_call_per_turn():
    with stack() as s:
        messages = conversation(1)
        statuses = []
        for turn in range(40):
            response = s.chat(messages, max_tokens=100)
            assert response.status_code == 200
            assert response.json()["usage"]["prompt_tokens"] <= 900
            statuses.append((response.headers["x-trim-status"], "x-prompt-tokens-estimate" in response.headers))
            _wait_for_background_counts(s.step)
            messages = [
                *messages,
                {"role": "assistant" if turn % 2 == 0 else "user", "content": f"reply{turn} " + "w " * 19},
            ]
        calls = s.target.calls
        # Calibration: 4 single-message probes and 3 longer ones (lengths 2, 3, 3).
        assert sorted(calls[:7]) == [1, 1, 1, 1, 2, 3, 3]
        # Then every message of the conversation is tokenized alone exactly once...
        assert calls[7:].count(1) == len(messages) - 1
        # ...and whole lists only to verify estimates that land within 8 tokens of the budget.
        assert len(calls[7:]) - calls[7:].count(1) <= statuses.count(("trimmed", True))
        # Early turns, far under budget, went out before their new message was counted.
        assert ("kept", False) in statuses
        assert statuses[-1] == ("trimmed", True)


def _wait_for_background_counts(step: HistoryTrimming) -> None:
    wait_for(lambda: not step.counting_in_background, interval=0.005)


class _Recorder:
    """A tiny ASGI app that records what it received and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[bytes, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.headers.append(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _request(raw: bytes):
    return parse_request(raw, BY_NAME["chat"])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "standin", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
        b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}',
    ],
)
async def test_what_is_not_a_trimmable_chat_request_passes_untouched(raw):
    """Bodies the router cannot parse never reach the step (test_middleware.py has those)."""
    target = StandinTarget(TrimmingConfig(), max_model_len=10)

    async def lookup(model):
        return target if model == MODEL else None

    request = _request(raw)
    await HistoryTrimming(lookup=lookup)(request)
    assert request.raw is raw
    assert request.response_headers == []
    assert request.trimmed_messages is None
    assert target.calls == []


async def test_a_rewritten_body_is_the_kept_messages_serialised_once():
    engine = build_app(StandinConfig(model=MODEL))
    target = StandinTarget(TrimmingConfig(history_budget_tokens=100))

    async def lookup(model):
        return target

    raw = json.dumps({"model": MODEL, "messages": conversation(20)}).encode()
    request = _request(raw)
    with serve_in_thread(engine) as engine_url:
        target.url = engine_url
        await HistoryTrimming(lookup=lookup)(request)
    assert dict(request.response_headers)[b"x-trim-status"] == b"trimmed"
    sent = json.loads(request.raw)
    assert sent == request.body and sent["model"] == MODEL
    assert count_chat_tokens(sent["messages"]) <= 100
    assert request.trimmed_messages == 20 - len(sent["messages"]) + 1
    assert request.trimmed_tokens == count_chat_tokens(conversation(20)) - count_chat_tokens(sent["messages"])


def test_other_paths_and_methods_are_not_touched():
    with stack() as s:
        assert "x-trim-status" not in httpx.get(f"{s.url}/v1/models").headers
        response = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 200 and "x-trim-status" not in response.headers
        assert s.target.calls == []


def test_an_unknown_context_length_without_a_history_budget_is_reported():
    with stack(max_model_len=None) as s:
        response = s.chat(conversation(3))
        assert response.status_code == 200
        assert response.headers["x-trim-status"] == "no-budget"


@dataclass
class ToolRenderingTarget(StandinTarget):
    """A stand-in tokenizer whose template renders each tool definition as 50 tokens."""

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool, tools=None) -> int:
        return await super().tokenize(messages, add_generation_prompt) + 50 * len(tools or [])


def test_tool_definitions_count_against_the_budget_when_the_tokenizer_takes_them():
    recorder = _Recorder()
    engine = build_app(StandinConfig(model=MODEL))
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(2)]
    messages = conversation(20)  # 34 + 20 * 24 + 3 = 517 tokens
    with serve_in_thread(engine) as engine_url:
        for target, room in (
            (ToolRenderingTarget(TrimmingConfig(mode="window", history_budget_tokens=400)), 300),
            (StandinTarget(TrimmingConfig(mode="window", history_budget_tokens=400)), 400),
        ):
            target.url = engine_url

            async def lookup(model, target=target):
                return target

            with serve_in_thread(StepRouter(HistoryTrimming(lookup=lookup), recorder)) as url:
                response = httpx.post(
                    f"{url}/v1/chat/completions",
                    verify=_TLS,
                    json={"model": MODEL, "messages": messages, "tools": tools},
                )
            assert response.headers["x-trim-status"] == "trimmed"
            kept = json.loads(recorder.bodies[-1])["messages"]
            assert room - 2 * 24 < count_chat_tokens(kept) <= room
            assert int(response.headers["x-prompt-tokens-estimate"]) == count_chat_tokens(kept) + 400 - room
