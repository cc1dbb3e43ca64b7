"""History trimming of Responses requests (`/v1/responses`): the step in front of a stand-in engine
that serves Responses and refuses over-long prompts as vLLM does (standin/responses.py).

The budget, the modes, the headers and the invariants are chat's: `instructions` and leading
system/developer items are kept, the newest turns are kept, a `function_call` never loses its
`function_call_output`; `x-trimmed-messages` counts input items. A request that continues a
stored response (`previous_response_id`) passes untouched with `x-trim-status: previous-response`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from server.config import TrimmingConfig
from server.gateway.trimming.counter import TokenCounter
from server.gateway.trimming.history import responses_history
from server.gateway.trimming.step import HistoryTrimming
from standin import count_chat_tokens
from standin.responses import ResponsesStandin
from tests.gateway.trimming.harness import StepRouter
from tests.gateway.trimming.responses_input import responses_conversation
from tests.gateway.trimming.test_step import MODEL, StandinTarget
from tests.support import serve_in_thread


@dataclass
class Stack:
    url: str
    engine: ResponsesStandin
    target: StandinTarget

    def create(self, items: Any, headers: dict | None = None, **extra: Any) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/responses",
            headers=headers or {},
            timeout=10.0,
            json={"model": MODEL, "input": items, **extra},
        )


@contextlib.contextmanager
def stack(mode: str = "auto", *, max_model_len: int = 1000, max_calls: int = 256, **trimming: Any) -> Iterator[Stack]:
    engine = ResponsesStandin.build(responses_history, model=MODEL, max_model_len=max_model_len)
    target = StandinTarget(TrimmingConfig(mode=mode, **trimming), max_model_len=max_model_len)

    async def lookup(model: str) -> StandinTarget | None:
        return target if model == MODEL else None

    step = HistoryTrimming(lookup=lookup, counter=TokenCounter(max_calls=max_calls))
    with serve_in_thread(StepRouter(step, engine)) as url:
        target.url = url
        yield Stack(url, engine, target)


def prompt_tokens(body: dict[str, Any]) -> int:
    history = responses_history(body)
    assert history is not None
    return count_chat_tokens(history.messages)


def test_a_long_responses_conversation_is_trimmed_to_the_budget_keeping_calls_with_outputs():
    items = responses_conversation(40)
    body = {"model": MODEL, "input": items, "instructions": "be brief", "max_output_tokens": 100}
    assert prompt_tokens(body) > 900
    with stack("window", max_calls=64) as s:
        response = s.create(items, instructions="be brief", max_output_tokens=100)
        assert response.status_code == 200, response.text
        sent = s.engine.responses[-1]
        kept = sent["input"]
        assert sent["instructions"] == "be brief" and sent["max_output_tokens"] == 100
        assert kept[0] == items[0] and kept[-1] == items[-1]
        assert kept[1:] == items[len(items) - len(kept) + 1 :]
        assert kept[1]["role"] == "user"  # resumes on a user turn
        calls = {i["call_id"] for i in kept if i.get("type") == "function_call"}
        outputs = {i["call_id"] for i in kept if i.get("type") == "function_call_output"}
        assert calls == outputs and calls
        used = response.json()["usage"]["input_tokens"]
        assert used == prompt_tokens(sent) <= 900
        assert response.headers["x-trim-status"] == "trimmed"
        assert int(response.headers["x-trimmed-messages"]) == len(items) - len(kept)  # items
        assert int(response.headers["x-prompt-tokens-estimate"]) == used
        # 108 items are more new messages than one request counts here (max_calls=64): the oldest,
        # which could not be sent anyway, are estimated from their size.
        dropped = prompt_tokens(body) - used
        assert abs(int(response.headers["x-trimmed-tokens"]) - dropped) <= dropped // 10
        # Sent again: the same cut, and no call (those old items cannot be sent: never counted).
        calls = len(s.target.calls)
        again = s.create(items, instructions="be brief", max_output_tokens=100)
        assert s.engine.responses[-1] == sent
        assert again.headers["x-trimmed-tokens"] == response.headers["x-trimmed-tokens"]
        assert len(s.target.calls) == calls


def test_untrimmed_the_same_request_is_refused_by_the_engine():
    items = responses_conversation(40)
    with stack("off") as s:
        response = s.create(items, instructions="be brief", max_output_tokens=100)
        assert response.status_code == 400
        assert "maximum context length" in response.json()["error"]["message"]
        assert "x-trim-status" not in response.headers


def test_a_short_responses_request_passes_byte_for_byte():
    with stack() as s:
        response = s.create("Plan a day in Lisbon.", max_output_tokens=16)
        assert response.status_code == 200
        assert response.headers["x-trim-status"] == "kept"
        assert s.engine.responses[-1] == {"model": MODEL, "input": "Plan a day in Lisbon.", "max_output_tokens": 16}


def test_the_answer_reservation_is_max_output_tokens():
    items = responses_conversation(13)
    assert prompt_tokens({"input": items}) == 801
    with stack() as s:
        assert s.create(items, max_output_tokens=50).headers["x-trim-status"] == "kept"
        response = s.create(items, max_output_tokens=400)
        assert response.headers["x-trim-status"] == "trimmed"
        assert response.json()["usage"]["input_tokens"] <= 600


def test_a_previous_response_id_passes_untouched_and_says_so():
    items = responses_conversation(40)
    with stack() as s:
        response = s.create(items, previous_response_id="resp_abc", max_output_tokens=100)
        assert response.headers["x-trim-status"] == "previous-response"
        assert "x-trimmed-messages" not in response.headers
        assert s.engine.last_input == items  # not trimmed: the engine's stored part is unknown here
        assert s.target.calls == []  # not even counted


def test_strict_mode_refuses_naming_the_input():
    with stack("strict") as s:
        response = s.create(responses_conversation(40), max_output_tokens=100)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert response.headers["x-trim-status"] == "rejected"
        assert s.engine.responses == []


def test_an_input_trimming_cannot_read_passes_through():
    items = [{"type": "item_reference", "id": "msg_1"}, *responses_conversation(40)]
    with stack() as s:
        response = s.create(items, max_output_tokens=100)
        assert "x-trim-status" not in response.headers
        assert s.engine.last_input == items
        assert s.target.calls == []


def test_watermarks_keep_the_responses_cut_still_between_cuts():
    """As for chat: the engine sees each prompt extend the previous one, except at a few cuts."""
    with stack() as s:
        items = responses_conversation(1)
        received = []
        for turn in range(24):
            response = s.create(items, max_output_tokens=100)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["input_tokens"] <= 900
            received.append(s.engine.last_input)
            answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a " * 20}]}
            items = [*items, answer, {"role": "user", "content": f"next{turn} " + "w " * 19}]
        cuts = [t for t in range(1, 24) if received[t][: len(received[t - 1])] != received[t - 1]]
        assert cuts and len(cuts) <= 3
        for t in cuts:
            assert received[t][0] == items[0] and received[t][1]["role"] == "user"
