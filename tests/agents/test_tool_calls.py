"""Tool calling with the real OpenAI SDK through the gateway to the real vLLM engine (tiny-cpu).

The tiny model's weights are random, so it never chooses a tool by itself: these tests name the
tool or require one, and vLLM's guided decoding (xgrammar, on the profile's hermes tool-call
format) makes its calls well-formed, with arguments held to each function's JSON schema. Every
request has a `seed`, so the random model answers the same way on every run.
"""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

from examples.trip_planner_agent import TOOLS

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Plan a rainy day in Porto."}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 400  # the random model writes a lot of whitespace between JSON tokens


def assert_valid_calls(calls) -> list[tuple[str, dict]]:
    """Each call names a known function and its arguments parse and match that function's schema."""
    assert calls, "no tool call"
    parsed = []
    for call in calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        parsed.append((call.function.name, arguments))
    return parsed


def test_auto_tool_choice_answers_200(client, agent_gateway):
    # The SDK's default tool_choice with tools is "auto": vLLM refused it (400) before the profiles
    # set enable-auto-tool-choice and a tool-call parser.
    raw = client.chat.completions.with_raw_response.create(
        model=agent_gateway.model, messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=1
    )
    assert raw.status_code == 200
    answer = raw.parse().choices[0]
    assert answer.finish_reason in {"stop", "length", "tool_calls"}
    if answer.message.tool_calls:
        assert_valid_calls(answer.message.tool_calls)


def test_required_returns_calls_whose_arguments_match_the_schema(client, agent_gateway):
    finished = 0
    for seed in (3, 4, 5):  # parallel calls may run past max_tokens (then the answer is cut)
        answer = client.chat.completions.create(
            model=agent_gateway.model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        if answer.choices[0].finish_reason == "tool_calls":
            assert_valid_calls(answer.choices[0].message.tool_calls)
            finished += 1
    assert finished >= 2


def test_a_named_function_is_the_one_called(client, agent_gateway):
    for seed in (1, 2, 3):
        answer = client.chat.completions.create(
            model=agent_gateway.model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        ((name, arguments),) = assert_valid_calls(answer.choices[0].message.tool_calls)
        assert name == "get_weather" and 1 <= arguments["day"] <= 7


def test_tools_without_strict_get_schema_valid_arguments_from_the_profile(client, agent_gateway):
    """tiny-cpu sets tool-strict-level: parameter, so a client that does not mark its tools
    `strict` (most agent frameworks) still gets arguments it can parse, even from random weights."""
    loose = copy.deepcopy(TOOLS)
    for tool in loose:
        del tool["function"]["strict"]
    for choice in ("required", NAMED):
        answer = client.chat.completions.create(
            model=agent_gateway.model, messages=MESSAGES, tools=loose, tool_choice=choice, max_tokens=MAX_TOKENS, seed=5
        )
        assert_valid_calls(answer.choices[0].message.tool_calls)


def test_parallel_tool_calls(client, agent_gateway):
    """The engine returns several calls in one answer when the client allows it (the OpenAI
    default), and exactly one with parallel_tool_calls=False."""
    several = None
    for seed in range(12):
        answer = client.chat.completions.create(
            model=agent_gateway.model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            seed=seed,
        )
        if answer.choices[0].finish_reason == "tool_calls" and len(answer.choices[0].message.tool_calls) >= 2:
            several = answer
            break
    assert several is not None, "no seed gave parallel calls"
    calls = several.choices[0].message.tool_calls
    assert_valid_calls(calls)
    assert len({call.id for call in calls}) == len(calls)
    single = client.chat.completions.create(
        model=agent_gateway.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        seed=seed,
        parallel_tool_calls=False,
    )
    assert len(assert_valid_calls(single.choices[0].message.tool_calls)) == 1


def reassemble(chunks) -> tuple[str, list[dict]]:
    """A streamed answer's content and tool calls, put back together from the deltas by index."""
    content, calls = [], {}
    for chunk in chunks:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or part.id
                call["name"] += part.function.name or "" if part.function else ""
                call["arguments"] += part.function.arguments or "" if part.function else ""
    return "".join(content), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_tool_call_deltas_reassemble_into_the_same_call(client, agent_gateway, choice):
    request = dict(
        model=agent_gateway.model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS, seed=7
    )
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    with client.chat.completions.create(**request, stream=True) as stream:
        content, streamed = reassemble(stream)
    assert not content.strip()
    assert [c["name"] for c in streamed] == [c.function.name for c in whole]
    # The non-streamed answer re-serialises the arguments; the streamed one is the model's own text.
    assert [json.loads(c["arguments"]) for c in streamed] == [json.loads(c.function.arguments) for c in whole]
    assert all(c["id"] for c in streamed)


def sse_payloads(text: str) -> list[dict]:
    """The JSON events of an SSE body, without the fields that differ on every request."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            event.pop("id", None), event.pop("created", None)
            for choice in event.get("choices", []):
                for call in choice.get("delta", {}).get("tool_calls") or []:
                    call.pop("id", None)
            events.append(event)
    return events


def test_streamed_tool_calls_pass_the_gateway_untouched(agent_gateway, real_engine):
    body = dict(
        model=agent_gateway.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=MAX_TOKENS,
        seed=11,
        stream=True,
    )
    through = httpx.post(f"{agent_gateway.url}/v1/chat/completions", json=body, timeout=120)
    direct = httpx.post(f"{real_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert through.status_code == direct.status_code == 200
    assert through.text.rstrip().endswith("data: [DONE]")
    events = sse_payloads(through.text)
    assert any(c.get("delta", {}).get("tool_calls") for e in events for c in e["choices"])
    # vLLM may put several tokens in one chunk when its reader falls behind (a busy machine), so
    # the chunk boundaries of two runs differ; what the client assembles from them may not.
    assert assembled(events) == assembled(sse_payloads(direct.text))


def assembled(events: list[dict]) -> dict:
    """What a client builds from a chat stream: per choice the role, text, tool calls and finish reason."""
    choices: dict[int, dict] = {}
    for event in events:
        for choice in event.get("choices", []):
            into = choices.setdefault(choice["index"], {"content": "", "tool_calls": {}, "finish_reason": None})
            delta = choice.get("delta", {})
            into["role"] = delta.get("role", into.get("role"))
            into["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = into["tool_calls"].setdefault(call["index"], {"type": None, "name": "", "arguments": ""})
                slot["type"] = call.get("type", slot["type"])
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            into["finish_reason"] = choice.get("finish_reason") or into["finish_reason"]
    return choices


def test_time_to_first_token_counts_a_tool_call_answer(client, agent_gateway):
    """A tool-call answer streams no text: its first token is the first tool-call delta."""
    ttft = "gateway_time_to_first_token_seconds_count"
    itl = "gateway_inter_token_latency_seconds_count"
    before, itl_before = agent_gateway.metric(ttft), agent_gateway.metric(itl)
    with client.chat.completions.create(
        model=agent_gateway.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=MAX_TOKENS,
        seed=13,
        stream=True,
    ) as stream:
        content, calls = reassemble(stream)
    assert calls and not content
    assert agent_gateway.metric(ttft) == before + 1
    assert agent_gateway.metric(itl) > itl_before  # the argument deltas are the tokens that follow


def test_tool_calls_and_results_go_back_to_the_model(client, agent_gateway, real_engine):
    """A call and its result in the history: accepted, and rendered by the tiny model's template in
    the format the hermes parser reads."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Porto", "day": 2}'},
    }
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "rain"}'},
    ]
    answer = client.chat.completions.create(
        model=agent_gateway.model, messages=history, tools=TOOLS, max_tokens=8, seed=1
    )
    assert answer.choices[0].message.role == "assistant"
    tokens = httpx.post(
        f"{real_engine.url}/tokenize", timeout=30, json={"model": agent_gateway.model, "messages": history}
    ).json()["tokens"]
    prompt = httpx.post(
        f"{real_engine.url}/detokenize", timeout=30, json={"model": agent_gateway.model, "tokens": tokens}
    ).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Porto", "day": 2}}\n</tool_call>' in prompt
    assert '<|im_start|>tool\n{"forecast": "rain"}<|im_end|>' in prompt
