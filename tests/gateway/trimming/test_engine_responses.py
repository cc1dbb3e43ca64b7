"""Responses trimming against the real vLLM engine (tiny model), with the OpenAI SDK.

A Responses conversation (instructions, user and assistant messages, function calls with their
outputs) longer than the engine's max_model_len: sent to the engine directly it is refused for
its length; through the gateway it is trimmed and answered, the engine's `usage.input_tokens`
stays within the budget, and the engine's `/tokenize` of what was sent, read as the gateway reads
it, equals that usage (so the gateway reads `input` the way vLLM renders it).
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from server.config import TrimmingConfig
from server.deploy.plan import plan_deployment
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings, ModelEngines
from server.gateway.trimming.history import responses_history
from tests.gateway.trimming.test_engine_e2e import _text
from tests.support import serve_in_thread

pytestmark = pytest.mark.engine

ANSWER_TOKENS = 8


def _conversation(rng: random.Random, turns: int) -> list[dict]:
    items: list[dict] = [{"role": "developer", "content": _text(rng, 300)}]
    for turn in range(turns):
        items.append({"role": "user", "content": [{"type": "input_text", "text": _text(rng, 300)}]})
        if turn % 3 == 1:
            call_id = f"call_{turn}"
            items.append(
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "search_places",
                    "arguments": '{"city": "Lisbon"}',
                }
            )
            items.append({"type": "function_call_output", "call_id": call_id, "output": _text(rng, 200)})
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": _text(rng, 300)}],
            }
        )
    items.append({"role": "user", "content": "And what about the evening?"})
    return items


def test_a_long_responses_conversation_is_refused_direct_and_answered_trimmed(real_engine):
    rng = random.Random(13)
    items = _conversation(rng, 24)
    instructions = "You are a travel assistant. " + _text(rng, 200)
    budget = real_engine.max_model_len - ANSWER_TOKENS
    settings = GatewaySettings(
        models=[ModelEngines(name=real_engine.model, urls=[real_engine.url], trimming=TrimmingConfig(mode="auto"))]
    )
    with (
        serve_in_thread(
            create_app(settings, plan_deployment(settings.models).served_models(), log_request=None)
        ) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as gateway,
        openai.OpenAI(base_url=f"{real_engine.url}/v1", api_key="unused", max_retries=0, timeout=120) as direct,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            direct.responses.create(
                model=real_engine.model, input=items, instructions=instructions, max_output_tokens=ANSWER_TOKENS
            )
        assert "context length" in str(refused.value) or "max_model_len" in str(refused.value)

        raw = gateway.responses.with_raw_response.create(
            model=real_engine.model,
            input=items,
            instructions=instructions,
            max_output_tokens=ANSWER_TOKENS,
            temperature=0,
        )
        assert raw.status_code == 200
        assert raw.headers["x-trim-status"] == "trimmed"
        assert int(raw.headers["x-trimmed-messages"]) > 0
        response = raw.parse()
        assert response.status == "completed" or response.status == "incomplete"
        used = response.usage.input_tokens
        assert used <= budget
        # The gateway's estimate (per-message counts summed) may only err upwards, and slightly.
        assert used <= int(raw.headers["x-prompt-tokens-estimate"]) <= used * 1.02
        # What was sent, read as the gateway reads it and counted by the engine's /tokenize, is
        # exactly what the engine's Responses path rendered: the two read `input` alike.
        dropped = int(raw.headers["x-trimmed-messages"])
        kept = items[:1] + items[1 + dropped :]
        assert kept[1]["role"] == "user"
        history = responses_history({"input": kept, "instructions": instructions})
        count = httpx.post(
            f"{real_engine.url}/tokenize",
            json={"model": real_engine.model, "messages": history.messages, "add_generation_prompt": True},
            timeout=30,
        ).json()["count"]
        assert count == used

        # A follow-up continues the stored response: the gateway builds the whole input from its
        # own store (app.responses) and trims it like any other.
        follow = gateway.responses.with_raw_response.create(
            model=real_engine.model,
            input="And tomorrow?",
            previous_response_id=response.id,
            max_output_tokens=ANSWER_TOKENS,
        )
        assert follow.status_code == 200
        assert follow.headers["x-trim-status"] == "trimmed"
        assert int(follow.headers["x-trimmed-messages"]) > 0
        assert follow.parse().previous_response_id == response.id
