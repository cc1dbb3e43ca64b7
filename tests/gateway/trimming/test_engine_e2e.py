"""The seed's scenario against the real vLLM engine, through the gateway, with the OpenAI SDK.

A 500-character system prompt, 2,000 characters of retrieved context, and a conversation that
grows turn after turn past the engine's max_model_len. Sent to the engine directly, a prompt
over max_model_len gets 400; through the gateway every turn gets 200, the engine receives the
system prompt and the context every time (seen in vLLM's `return_prompt_text`), and its
`usage.prompt_tokens` never exceeds the budget and equals the gateway's own count.
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
from tests.support import serve_in_thread

pytestmark = pytest.mark.engine

ANSWER_TOKENS = 8
WORDS = (
    "the quick brown fox jumps over a lazy dog while travellers plan an itinerary across "
    "Europe by train with hotels museums markets and food"
).split()


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def _tokenize(engine_url: str, model: str, messages: list[dict]) -> int:
    response = httpx.post(
        f"{engine_url}/tokenize",
        timeout=10.0,
        json={
            "model": model,
            "messages": messages,
            "add_generation_prompt": True,
        },
    )
    response.raise_for_status()
    return response.json()["count"]


def test_a_growing_conversation_gets_200_through_the_gateway_where_the_engine_says_400(real_engine):
    rng = random.Random(4)
    system = _text(rng, 500)
    context = "Retrieved documents:\n" + _text(rng, 2000)
    messages = [{"role": "system", "content": system}, {"role": "system", "content": context}]
    budget = real_engine.max_model_len - ANSWER_TOKENS

    settings = GatewaySettings(
        models=[
            ModelEngines(
                name=real_engine.model,
                urls=[real_engine.url],
                trimming=TrimmingConfig(mode="auto"),
            )
        ]
    )
    over_limit_turns = 0
    with (
        serve_in_thread(
            create_app(settings, plan_deployment(settings.models).served_models(), log_request=None)
        ) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as gateway,
        openai.OpenAI(base_url=f"{real_engine.url}/v1", api_key="unused", max_retries=0, timeout=60) as direct,
    ):
        for turn in range(40):
            messages.append({"role": "user", "content": f"Question {turn}: " + _text(rng, 300)})
            full = _tokenize(real_engine.url, real_engine.model, messages)

            raw = gateway.chat.completions.with_raw_response.create(
                model=real_engine.model,
                messages=messages,
                max_tokens=ANSWER_TOKENS,
                temperature=0,
                extra_body={"return_prompt_text": True},
            )
            assert raw.status_code == 200
            completion = raw.parse()
            prompt_tokens = completion.usage.prompt_tokens
            prompt_text = completion.model_extra["prompt_text"]
            dropped = int(raw.headers["x-trimmed-messages"])

            # The engine never got more than the budget; the gateway's count is the engine's
            # (a prompt far under budget is sent before its new message is counted: no header).
            assert prompt_tokens <= budget
            estimate = raw.headers.get("x-prompt-tokens-estimate")
            assert estimate is None or int(estimate) == prompt_tokens
            # What the engine received: both instructions, then the newest turns, in order.
            assert prompt_text.startswith(
                f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>system\n{context}<|im_end|>\n"
            )
            assert prompt_text.endswith(f"{messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
            kept = messages[:2] + messages[2 + dropped :]
            assert _tokenize(real_engine.url, real_engine.model, kept) == prompt_tokens

            if full <= budget:
                assert raw.headers["x-trim-status"] == "kept" and dropped == 0
                assert prompt_tokens == full
            else:
                assert raw.headers["x-trim-status"] == "trimmed" and dropped > 0
                assert int(estimate) == prompt_tokens
                assert kept[2]["role"] == "user"
                assert int(raw.headers["x-trimmed-tokens"]) == full - prompt_tokens
            if full > real_engine.max_model_len:
                over_limit_turns += 1
                with pytest.raises(openai.BadRequestError):
                    direct.chat.completions.create(
                        model=real_engine.model,
                        messages=messages,
                        max_tokens=ANSWER_TOKENS,
                    )
                if over_limit_turns == 4:
                    break
            messages.append({"role": "assistant", "content": completion.choices[0].message.content or "ok"})
    assert over_limit_turns == 4


def test_streaming_is_trimmed_and_a_strict_request_is_refused_with_both_numbers(real_engine):
    rng = random.Random(5)
    messages = [{"role": "system", "content": _text(rng, 500)}]
    for turn in range(30):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _text(rng, 300)})
    full = _tokenize(real_engine.url, real_engine.model, messages)
    assert full > real_engine.max_model_len
    budget = real_engine.max_model_len - ANSWER_TOKENS
    settings = GatewaySettings(
        models=[
            ModelEngines(
                name=real_engine.model,
                urls=[real_engine.url],
                trimming=TrimmingConfig(mode="auto"),
            )
        ]
    )
    with (
        serve_in_thread(
            create_app(settings, plan_deployment(settings.models).served_models(), log_request=None)
        ) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as gateway,
    ):
        with gateway.chat.completions.with_streaming_response.create(
            model=real_engine.model,
            messages=messages,
            max_tokens=ANSWER_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        ) as response:
            assert response.headers["x-trim-status"] == "trimmed"
            chunks = list(response.parse())
        usage = chunks[-1].usage
        assert usage.prompt_tokens == int(response.headers["x-prompt-tokens-estimate"]) <= budget
        assert any(c.choices and c.choices[0].delta.content for c in chunks)

        with pytest.raises(openai.BadRequestError) as refused:
            gateway.chat.completions.create(
                model=real_engine.model,
                messages=messages,
                max_tokens=ANSWER_TOKENS,
                extra_headers={"x-trim-mode": "strict"},
            )
        assert refused.value.code == "context_length_exceeded"
        assert refused.value.param == "messages"
        assert str(full) in refused.value.message and str(budget) in refused.value.message


async def test_counts_from_the_real_template_add_up_and_bounds_hold(real_engine):
    """Per-message counts of the real tokenizer and template sum to the whole prompt's count
    (developer messages, which vLLM folds into the system message, only ever over-count), and
    the upper bound used before a message is counted is never below its real count."""
    from server.gateway.trimming.counter import TokenCounter

    async with httpx.AsyncClient(base_url=real_engine.url, timeout=10.0) as client:

        async def tokenize(messages, add_generation_prompt):
            response = await client.post(
                "/tokenize",
                json={
                    "model": real_engine.model,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                },
            )
            response.raise_for_status()
            return response.json()["count"]

        rng = random.Random(6)
        odd = ["東京 ü ß 🙂🙂", "   spaced    out   ", "1234567890" * 5, "<|im_end|> not special?", "\n\n\t"]
        conversation = [{"role": "system", "content": _text(rng, 200)}]
        for i in range(12):
            conversation.append({"role": "user", "content": rng.choice(odd) + _text(rng, 80)})
            conversation.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"c{i}",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": f'{{"q": "{rng.choice(odd).strip()}"}}'},
                        },
                    ],
                }
            )
            conversation.append({"role": "tool", "tool_call_id": f"c{i}", "content": rng.choice(odd)})
        counter = TokenCounter()
        await counter.count(real_engine.model, tokenize, conversation[:1])
        bounds = counter.estimate_cached(real_engine.model, conversation)
        exact = await counter.count(real_engine.model, tokenize, conversation)
        assert exact.total == await tokenize(conversation, True)
        assert counter.calibration(real_engine.model).trusted
        for bound, count in zip(bounds.per_message[1:], exact.per_message[1:], strict=True):
            assert count <= bound

        with_developer = [*conversation[:1], {"role": "developer", "content": "Answer in French."}, *conversation[1:]]
        estimate = (await counter.count(real_engine.model, tokenize, with_developer)).total
        assert estimate >= await tokenize(with_developer, True)


def test_watermarks_keep_the_prefix_cache_hitting_where_the_moving_window_misses(real_engine):
    """The seed's conversation, once per mode (different texts, so neither reuses the other's
    cache): over the turns after trimming starts, the engine finds at least 80% of each
    watermark prompt in its prefix cache (`usage.prompt_tokens_details.cached_tokens`), and
    more than it finds of the moving window's prompts, which change right after the instructions
    on every turn."""
    settings = GatewaySettings(
        models=[
            ModelEngines(
                name=real_engine.model,
                urls=[real_engine.url],
                trimming=TrimmingConfig(mode="auto"),
            )
        ]
    )
    share: dict[str, float] = {}
    with (
        serve_in_thread(
            create_app(settings, plan_deployment(settings.models).served_models(), log_request=None)
        ) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as gateway,
    ):
        for mode, seed in (("window", 21), ("auto", 22)):
            rng = random.Random(seed)
            messages = [
                {"role": "system", "content": _text(rng, 500)},
                {"role": "system", "content": "Retrieved documents:\n" + _text(rng, 2000)},
            ]
            prompt = cached = trimmed = 0
            for turn in range(24):
                messages.append({"role": "user", "content": f"Question {turn}: " + _text(rng, 80)})
                raw = gateway.chat.completions.with_raw_response.create(
                    model=real_engine.model,
                    messages=messages,
                    max_tokens=ANSWER_TOKENS,
                    temperature=0,
                    extra_headers={"x-trim-mode": mode},
                )
                usage = raw.parse().usage
                assert usage.prompt_tokens_details is not None  # the profile's --enable-prompt-tokens-details
                if raw.headers["x-trim-status"] == "trimmed":
                    trimmed += 1
                    prompt += usage.prompt_tokens
                    cached += usage.prompt_tokens_details.cached_tokens or 0
                messages.append({"role": "assistant", "content": _text(rng, 250)})
            assert trimmed >= 16
            share[mode] = cached / prompt
    assert share["auto"] >= 0.8
    assert share["window"] < share["auto"]
