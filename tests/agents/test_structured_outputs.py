"""Structured outputs (`response_format`) with the real OpenAI SDK through the gateway (tiny-cpu).

vLLM's CPU build decodes them with its `auto` structured-outputs backend, which is xgrammar
(guidance, i.e. llguidance, only for schema features xgrammar refuses). Guided decoding makes even
the tiny model's random weights write JSON that validates.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Plan two days in Lisbon as JSON."}]
PLAN = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Lisbon", "Porto", "Sintra"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
        "stops": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        },
        "budget_eur": {"type": "number", "minimum": 0, "maximum": 500},
    },
    "required": ["city", "days", "stops", "budget_eur"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "plan", "schema": PLAN, "strict": True}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(client, agent_gateway, seed):
    answer = client.chat.completions.create(
        model=agent_gateway.model, messages=MESSAGES, max_tokens=400, seed=seed, response_format=JSON_SCHEMA
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PLAN)


def test_streamed_json_schema_output_validates(client, agent_gateway):
    with client.chat.completions.create(
        model=agent_gateway.model, messages=MESSAGES, max_tokens=400, seed=4, response_format=JSON_SCHEMA, stream=True
    ) as stream:
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PLAN)


def test_the_sdks_parse_helper_returns_the_typed_object(client, agent_gateway):
    pydantic = pytest.importorskip("pydantic")

    class Forecast(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        day: int = pydantic.Field(ge=1, le=7)
        rain: bool

    answer = client.chat.completions.parse(
        model=agent_gateway.model, messages=MESSAGES, max_tokens=200, seed=2, response_format=Forecast
    )
    forecast = answer.choices[0].message.parsed
    assert isinstance(forecast, Forecast) and 1 <= forecast.day <= 7


def test_json_object_output_is_a_json_object(client, agent_gateway):
    """json_object allows any object: the random model's strings may not close within max_tokens
    (then the answer is a cut prefix), so seeds are tried until one answer finishes."""
    for seed in range(4):
        answer = client.chat.completions.create(
            model=agent_gateway.model,
            messages=MESSAGES,
            max_tokens=120,
            seed=seed,
            response_format={"type": "json_object"},
        )
        choice = answer.choices[0]
        assert choice.message.content.lstrip().startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            return
    pytest.fail("no seed gave a finished JSON object")
