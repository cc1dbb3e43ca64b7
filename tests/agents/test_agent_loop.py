"""The example agent (examples/trip_planner_agent.py) runs 30 turns through the gateway to the real
engine with trimming on: every turn calls its tool with valid arguments, the history outgrows the
tiny model's 2,048 tokens, the gateway trims it, every call stays with its result, nothing fails."""

from __future__ import annotations

import json

import jsonschema
import pytest

from examples.trip_planner_agent import TOOLS, run_agent

pytestmark = pytest.mark.engine

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
TURNS = 30
MAX_TOKENS = 192  # room for a named call: the random model writes whitespace between JSON tokens


def assert_every_call_is_kept_with_its_result(messages: list[dict]) -> None:
    issued: set[str] = set()
    for message in messages:
        if message["role"] == "assistant":
            issued.update(call["id"] for call in message.get("tool_calls") or [])
        elif message["role"] == "tool":
            assert message["tool_call_id"] in issued, "a tool result whose call was trimmed away"
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    assert issued == answered, "a tool call whose result was trimmed away"


def test_a_30_turn_agent_runs_through_the_gateway_with_trimming(agent_gateway, real_engine):
    already_sent = len(agent_gateway.sent)
    with agent_gateway.client() as client:
        turns, history = run_agent(client, agent_gateway.model, turns=TURNS, stream=True, max_tokens=MAX_TOKENS)
    sent = agent_gateway.sent[already_sent:]
    steps = [step for turn in turns for step in turn.steps]

    assert len(turns) == TURNS and len(sent) == len(steps)
    for turn in turns:
        # The named tool was called (the first step), with arguments that match its schema, and
        # its result went back to the model as a `tool` message.
        assert turn.calls and turn.calls[0]["name"] == turn.steps[0].message["tool_calls"][0]["function"]["name"]
        for call in turn.calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            assert "error" not in json.loads(call["result"])
        assert turn.steps[0].first_token_s is not None  # time to the first tool-call delta
        assert turn.steps[-1].finish_reason in {"stop", "length"}

    # Trimming started once the history outgrew the model, and every prompt fit.
    statuses = [step.trim_status for step in steps]
    assert statuses[0] == "kept" and "trimmed" in statuses
    budget = real_engine.max_model_len - MAX_TOKENS
    assert all(step.prompt_tokens is not None and step.prompt_tokens <= budget for step in steps)
    assert sum(step.trimmed_messages for step in steps) > 0

    # What the engine got: the system prompt, then the newest part of the agent's history,
    # cut between turns, with every tool call next to its result.
    for body, step in zip(sent, steps, strict=True):
        messages = body["messages"]
        assert messages[0] == history[0]
        kept = messages[1:]
        assert kept == history[step.sent_messages - len(kept) : step.sent_messages]
        assert len(messages) == step.sent_messages - step.trimmed_messages
        assert kept[0]["role"] == "user" or step.trimmed_messages == 0
        assert_every_call_is_kept_with_its_result(messages)
