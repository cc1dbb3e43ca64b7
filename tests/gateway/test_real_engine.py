"""The real OpenAI Python SDK against the gateway in front of the real vLLM engine (tiny model)."""

from __future__ import annotations

import openai
import pytest
from prometheus_client import CollectorRegistry

from server.config import ServedModel
from server.gateway.app import create_app
from server.gateway.settings import GatewaySettings
from tests.support import serve_in_thread

pytestmark = pytest.mark.engine

MESSAGES = [{"role": "user", "content": "Plan a day in Lisbon."}]
NO_EOS = {"ignore_eos": True}  # the tiny model's random weights may pick the end token early


@pytest.fixture(scope="module")
def gateway_url(real_engine):
    settings = GatewaySettings(auth={"api_keys_env": "TEST_REAL_ENGINE_GATEWAY_KEYS"})
    models = [ServedModel(real_engine.model, [real_engine.url], real_engine.profile)]
    app = create_app(
        settings, models, registry=CollectorRegistry(), environ={"TEST_REAL_ENGINE_GATEWAY_KEYS": "sk-test"}
    )
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-test", max_retries=0, timeout=60) as client:
        yield client


def test_models_list_carries_max_model_len(client, real_engine):
    models = client.models.list().data
    assert [m.id for m in models] == [real_engine.model]
    assert models[0].model_extra["max_model_len"] == real_engine.max_model_len


def test_chat(client, real_engine):
    answer = client.chat.completions.create(model=real_engine.model, messages=MESSAGES, max_tokens=8, extra_body=NO_EOS)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens > 0


def test_streaming_with_usage(client, real_engine):
    chunks = list(
        client.chat.completions.create(
            model=real_engine.model,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completions(client, real_engine):
    answer = client.completions.create(
        model=real_engine.model, prompt="Once upon a time", max_tokens=5, extra_body=NO_EOS
    )
    assert answer.object == "text_completion" and answer.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=real_engine.model, prompt="Once", max_tokens=3, stream=True))
    assert streamed and all(c.object == "text_completion" for c in streamed)


def test_unknown_model_is_the_sdks_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"


def test_bad_requests_are_the_sdks_bad_request_error(client, real_engine):
    with pytest.raises(openai.BadRequestError) as info:  # refused by the gateway itself
        client.chat.completions.create(model=real_engine.model, messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):  # refused by vLLM, passed through
        client.chat.completions.create(model=real_engine.model, messages=MESSAGES, max_tokens=-1)


def test_wrong_key_is_the_sdks_authentication_error(gateway_url, real_engine):
    with (
        openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-nope", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.chat.completions.create(model=real_engine.model, messages=MESSAGES)
