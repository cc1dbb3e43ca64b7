"""The trimming decision as a pure function, and the step around it, without a socket.

`decide` gets the messages, their counts and the budget and says keep, trim or refuse; the step
is driven here with an in-process tokenizer (one token per word, three per message, two for the
generation prompt), so every number is known in advance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from server.config import TrimmingConfig
from server.gateway.errors import InvalidRequest
from server.gateway.request.endpoints import BY_NAME
from server.gateway.request.request import GatewayRequest, parse_request
from server.gateway.trimming.decision import (
    Budget,
    Outcome,
    TrimOutcome,
    answer_tokens,
    decide,
    effective_mode,
    parse_mode,
    prompt_budget,
)
from server.gateway.trimming.step import HistoryTrimming

MODEL = "m"


def _messages(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w " * 8})
    return messages


# -- the pure decision --------------------------------------------------------------------------


def test_outcomes_are_an_enum_with_the_header_values():
    assert [o.value for o in Outcome] == [
        "kept",
        "trimmed",
        "unavailable",
        "rejected",
        "no-budget",
        "previous-response",
    ]
    assert TrimOutcome(Outcome.NO_BUDGET).response_headers() == [(b"x-trim-status", b"no-budget")]
    assert TrimOutcome(Outcome.UNAVAILABLE).response_headers() == [(b"x-trim-status", b"unavailable")]
    assert TrimOutcome(Outcome.TRIMMED, 3, 40, 90).response_headers() == [
        (b"x-trim-status", b"trimmed"),
        (b"x-trimmed-messages", b"3"),
        (b"x-trimmed-tokens", b"40"),
        (b"x-prompt-tokens-estimate", b"90"),
    ]
    assert TrimOutcome(Outcome.KEPT).response_headers() == [
        (b"x-trim-status", b"kept"),
        (b"x-trimmed-messages", b"0"),
        (b"x-trimmed-tokens", b"0"),
    ]


def test_a_history_that_fits_is_kept_with_its_count():
    messages = _messages(3)
    outcome = decide(messages, [10] * 4, 5, Budget(100, 200, 100), "auto")
    assert outcome.status is Outcome.KEPT and outcome.prompt_tokens == 45 and outcome.kept is None


def test_a_long_history_is_trimmed_to_the_budget_keeping_the_instructions():
    messages = _messages(9)  # system + 9 turns, 10 tokens each, overhead 5: 105
    outcome = decide(messages, [10] * 10, 5, Budget(60, None, 0), "window")
    assert outcome.status is Outcome.TRIMMED
    # Room for four turns after the instructions, but the kept history starts on a user turn: three.
    assert outcome.kept == [messages[0], *messages[7:]] and messages[7]["role"] == "user"
    assert (outcome.dropped_messages, outcome.dropped_tokens, outcome.prompt_tokens) == (6, 60, 45)


def test_a_lower_limit_cuts_further_without_changing_the_budget_named():
    messages = _messages(9)
    outcome = decide(messages, [10] * 10, 5, Budget(60, None, 0), "window", limit=35)
    assert outcome.kept == [messages[0], messages[9]] and outcome.prompt_tokens == 25


def test_strict_refuses_what_would_need_trimming_with_both_numbers():
    outcome = decide(_messages(9), [10] * 10, 5, Budget(60, 160, 100), "strict")
    assert outcome.status is Outcome.REJECTED and outcome.prompt_tokens == 105
    assert outcome.error is not None and outcome.error.code == "context_length_exceeded"
    assert "60 tokens (max_model_len 160 minus 100 tokens reserved for the answer)" in outcome.error.message
    assert "need 105 tokens" in outcome.error.message
    assert decide(_messages(3), [10] * 4, 5, Budget(60, 160, 100), "strict").status is Outcome.KEPT


def test_refuses_when_the_instructions_and_the_newest_message_do_not_fit():
    outcome = decide(_messages(3), [30, 1, 1, 40], 5, Budget(60, None, 0), "auto")
    assert outcome.status is Outcome.REJECTED and outcome.prompt_tokens == 75
    assert outcome.error is not None and "history_budget_tokens" in outcome.error.message
    assert "60" in outcome.error.message and "75" in outcome.error.message


def test_budget_and_modes():
    config = TrimmingConfig(default_max_tokens=50)
    assert answer_tokens({}, config) == 50
    assert answer_tokens({"max_tokens": 10, "max_completion_tokens": 20}, config) == 20
    assert answer_tokens({"max_tokens": True}, config) is None
    assert answer_tokens({"max_tokens": -1}, config) is None
    assert prompt_budget(1000, 50, config) == 950
    assert prompt_budget(1000, 50, TrimmingConfig(history_budget_tokens=300)) == 300
    assert prompt_budget(None, 50, config) is None
    assert parse_mode(None) is None and parse_mode(" Strict ") == "strict"
    with pytest.raises(InvalidRequest) as refused:
        parse_mode("loose")
    assert refused.value.code == "invalid_trim_mode" and refused.value.param == "x-trim-mode"
    assert effective_mode("auto", "off") == "auto" and effective_mode("auto", "strict") == "strict"


# -- the step, in process -----------------------------------------------------------------------


def _exact(messages: list[dict], add_generation_prompt: bool) -> int:
    return (2 if add_generation_prompt else 0) + sum(3 + len(str(m.get("content") or "").split()) for m in messages)


@dataclass
class Target:
    trimming: TrimmingConfig = field(default_factory=TrimmingConfig)
    max_model_len: int | None = 100
    fail: BaseException | None = None
    calls: int = 0

    async def tokenize(self, messages: list[dict], add_generation_prompt: bool) -> int:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return _exact(messages, add_generation_prompt)


class Metrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def trimmed(self, model: str, messages: int, tokens: int) -> None:
        self.calls.append((model, messages, tokens))


def _chat(messages: list[dict], headers: list | None = None, endpoint: str = "chat", **extra) -> GatewayRequest:
    raw = json.dumps({"model": MODEL, "messages": messages, **extra}).encode()
    return parse_request(raw, BY_NAME[endpoint], headers=headers or [])


def _step(target: Target, metrics: Metrics | None = None) -> HistoryTrimming:
    async def lookup(model: str) -> Target | None:
        return target if model == MODEL else None

    return HistoryTrimming(lookup=lookup, metrics=metrics, counter=None)


async def test_the_step_trims_the_body_and_reports_it():
    target, metrics = Target(), Metrics()
    messages = _messages(12)  # 5 + 12 * 13 + 2 = 163 tokens; budget 100 - 10
    request = _chat(messages, max_tokens=10)
    await _step(target, metrics)(request)
    kept = request.body["messages"]
    assert json.loads(request.raw) == request.body
    assert kept[0] == messages[0] and kept[-1] == messages[-1] and kept[1]["role"] == "user"
    sent = _exact(kept, True)
    assert sent <= 90
    headers = dict(request.response_headers)
    assert headers[b"x-trim-status"] == b"trimmed"
    assert int(headers[b"x-prompt-tokens-estimate"]) == sent
    assert request.trimmed_messages == len(messages) - len(kept) == int(headers[b"x-trimmed-messages"])
    assert request.trimmed_tokens == _exact(messages, True) - sent
    assert metrics.calls == [(MODEL, request.trimmed_messages, request.trimmed_tokens)]


async def test_a_refusal_raises_with_the_trim_headers_and_leaves_the_request_alone():
    target = Target(trimming=TrimmingConfig(mode="strict"))
    request = _chat(_messages(12), max_tokens=10)
    raw = request.raw
    with pytest.raises(InvalidRequest) as refused:
        await _step(target)(request)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert dict(refused.value.headers)[b"x-trim-status"] == b"rejected"
    assert dict(refused.value.headers)[b"x-prompt-tokens-estimate"] == b"163"
    assert request.raw is raw and request.response_headers == []


async def test_a_bad_mode_header_is_refused():
    request = _chat(_messages(2), headers=[(b"x-trim-mode", b"loose")])
    with pytest.raises(InvalidRequest) as refused:
        await _step(Target())(request)
    assert refused.value.code == "invalid_trim_mode"


@pytest.mark.parametrize("failure", [RuntimeError("tokenizer down"), KeyError("bug"), ZeroDivisionError()])
async def test_any_failure_while_counting_passes_the_request_through_as_unavailable(failure):
    target = Target(fail=failure)
    request = _chat(_messages(12), max_tokens=10)
    raw = request.raw
    await _step(target)(request)
    assert target.calls > 0
    assert request.raw is raw
    assert request.response_headers == [(b"x-trim-status", b"unavailable")]


async def test_a_failing_lookup_passes_the_request_through_untouched():
    async def lookup(model: str) -> Target | None:
        raise RuntimeError("pool reshaped under us")

    request = _chat(_messages(12), max_tokens=10)
    raw = request.raw
    await HistoryTrimming(lookup=lookup)(request)
    assert request.raw is raw and request.response_headers == []


async def test_endpoints_that_do_not_trim_history_are_not_looked_at():
    target = Target()
    request = parse_request(
        json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
        BY_NAME["completions"],
        headers=[(b"x-trim-mode", b"loose")],
    )
    await _step(target)(request)
    assert target.calls == 0 and request.response_headers == []


async def test_no_budget_is_reported():
    request = _chat(_messages(2))
    await _step(Target(max_model_len=None))(request)
    assert request.response_headers == [(b"x-trim-status", b"no-budget")]


def test_the_profile_names_the_modes_and_checks_the_low_mark():
    from pydantic import ValidationError

    assert TrimmingConfig().mode == "auto" and TrimmingConfig().low_mark == 0.65
    assert TrimmingConfig(mode="window", low_mark=1.0).mode == "window"
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValidationError):
            TrimmingConfig(low_mark=bad)
    with pytest.raises(ValidationError):
        TrimmingConfig(mode="sliding")


def test_auto_and_window_are_as_strict_so_a_request_chooses_between_them():
    assert effective_mode("auto", "window") == "window" and effective_mode("window", "auto") == "auto"
    assert effective_mode("window", "off") == "window" and effective_mode("strict", "window") == "strict"
    assert effective_mode("off", "window") == "window"
    assert parse_mode("Window") == "window"


def test_auto_cuts_further_than_the_window_and_says_so():
    messages = _messages(9)  # system + 9 turns, 10 tokens each, overhead 5: 105
    window = decide(messages, [10] * 10, 5, Budget(60, None, 0), "window")
    auto = decide(messages, [10] * 10, 5, Budget(60, None, 0), "auto", low_mark=0.5)
    assert auto.status is Outcome.TRIMMED and auto.prompt_tokens is not None
    assert auto.prompt_tokens <= 30 < window.prompt_tokens  # down to the low mark: 0.5 * 60
    assert auto.kept == [messages[0], messages[9]]
